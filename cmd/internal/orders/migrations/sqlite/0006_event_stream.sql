-- The JetStream stream that this database's order events go to (see the
-- PostgreSQL migration 0006): its creation time as JetStream reports it
-- and the NATS it was found on. An embedded database is usually one
-- instance's, but sqlite:PATH may name one file for instances with data
-- dirs (and embedded NATS servers) of their own.
CREATE TABLE event_stream (
    singleton     INTEGER NOT NULL PRIMARY KEY CHECK (singleton = 1),
    created       TEXT    NOT NULL,
    nats          TEXT    NOT NULL,
    registered_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))
);
