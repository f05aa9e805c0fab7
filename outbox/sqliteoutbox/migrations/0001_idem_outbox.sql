-- The transactional outbox: events added in the caller's transaction,
-- published by a relay (Take) and then marked sent.
CREATE TABLE IF NOT EXISTS idem_outbox (
	id           TEXT    NOT NULL PRIMARY KEY,
	-- seq orders the events of one ordering key: Add sets it to the
	-- largest seq plus one inside the caller's write transaction (SQLite
	-- has one writer at a time), so it follows the order of the commits.
	seq          INTEGER NOT NULL UNIQUE,
	ordering_key TEXT    NOT NULL,
	subject      TEXT    NOT NULL,
	body         BLOB    NOT NULL,
	created_at   INTEGER NOT NULL, -- Unix nanoseconds
	sent_at      INTEGER,          -- Unix nanoseconds; NULL until the broker acknowledged it
	attempts     INTEGER NOT NULL DEFAULT 0
);
-- Take's index, over the unsent rows only: it walks the keys with unsent
-- events (the first entry of each key is its oldest unsent event, the
-- key's head) and reads the events that follow a head in its key.
CREATE INDEX IF NOT EXISTS idem_outbox_unsent_key ON idem_outbox (ordering_key, seq) WHERE sent_at IS NULL;
