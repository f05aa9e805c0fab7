-- One random id per database. The Redis fast path prefixes its keys with
-- it, so that two deployments that share one Redis never share an entry
-- (a replay of another database's answer, a 409 for another's request).
CREATE TABLE deployment (
    singleton INTEGER NOT NULL PRIMARY KEY CHECK (singleton = 1),
    id        TEXT    NOT NULL
);
INSERT INTO deployment (singleton, id) VALUES (1, lower(hex(randomblob(16))));
