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
-- Take walks the unsent events by seq and looks, for each, for an older
-- unsent event of its key: both only over the unsent rows.
CREATE INDEX IF NOT EXISTS idem_outbox_unsent ON idem_outbox (seq) WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS idem_outbox_unsent_key ON idem_outbox (ordering_key, seq) WHERE sent_at IS NULL;
