-- One random id per database. The Redis fast path prefixes its keys with
-- it, so that two deployments that share one Redis never share an entry
-- (a replay of another database's answer, a 409 for another's request).
CREATE TABLE deployment (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    id        text    NOT NULL
);
INSERT INTO deployment (id) VALUES (replace(gen_random_uuid()::text, '-', ''));
