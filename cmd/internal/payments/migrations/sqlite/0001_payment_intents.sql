-- The gateway's ledger: one row per PaymentIntent, in the columns of
-- Stripe's object that the gateway uses.
CREATE TABLE payment_intents (
	id                   TEXT    NOT NULL PRIMARY KEY,
	account              TEXT    NOT NULL, -- AccountFor(the API key)
	amount               INTEGER NOT NULL,
	amount_capturable    INTEGER NOT NULL DEFAULT 0,
	amount_received      INTEGER NOT NULL DEFAULT 0,
	currency             TEXT    NOT NULL,
	status               TEXT    NOT NULL,
	capture_method       TEXT    NOT NULL DEFAULT '',
	confirmation_method  TEXT    NOT NULL DEFAULT '',
	description          TEXT,
	livemode             INTEGER NOT NULL DEFAULT 0,
	metadata             TEXT    NOT NULL DEFAULT '{}', -- JSON object
	payment_method       TEXT    NOT NULL DEFAULT '',
	payment_method_types TEXT    NOT NULL DEFAULT '[]', -- JSON array
	last_payment_error   TEXT,                          -- JSON object or NULL
	created              INTEGER NOT NULL, -- Unix seconds, as the API shows it
	-- When the row was written, Unix nanoseconds, for listing newest first
	-- (id breaks ties).
	created_at           INTEGER NOT NULL
) STRICT;

CREATE INDEX payment_intents_account_created ON payment_intents (account, created_at DESC, id DESC);
