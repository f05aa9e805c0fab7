-- The JetStream stream that this database's order events go to: its
-- creation time as JetStream reports it (which tells two streams of the
-- same name apart) and, for the operator, the NATS it was found on
-- (without credentials). The first instance to set up its stream records
-- it; an instance that would start an embedded NATS whose stream is
-- another one is refused at start, since the relays of both would drain
-- the one outbox into two streams. Deleting the row (when the recorded
-- NATS and its files are gone for good) lets the next instance record
-- its own.
CREATE TABLE event_stream (
    singleton     boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    created       text        NOT NULL,
    nats          text        NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now()
);
