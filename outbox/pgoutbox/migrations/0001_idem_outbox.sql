-- The transactional outbox: events added in the caller's transaction,
-- published by a relay (Take) and then marked sent.
CREATE TABLE IF NOT EXISTS idem_outbox (
	id           text        PRIMARY KEY,
	-- seq orders the events of one ordering key: drawn when the event is
	-- added, so an event added after another one's transaction committed
	-- has the larger seq.
	seq          bigint      GENERATED ALWAYS AS IDENTITY UNIQUE,
	ordering_key text        NOT NULL,
	subject      text        NOT NULL,
	body         bytea       NOT NULL,
	created_at   timestamptz NOT NULL,
	sent_at      timestamptz,           -- NULL until the broker acknowledged it
	attempts     integer     NOT NULL DEFAULT 0
);
-- Take's index, over the unsent rows only: it walks the keys with unsent
-- events (the first entry of each key is its oldest unsent event, the
-- key's head) and reads the events that follow a head in its key.
CREATE INDEX IF NOT EXISTS idem_outbox_unsent_key ON idem_outbox (ordering_key, seq) WHERE sent_at IS NULL;
