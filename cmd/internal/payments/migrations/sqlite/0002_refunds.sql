-- Refunds: one row per refund, and on each PaymentIntent how much of it
-- was refunded, which never exceeds what it received.
ALTER TABLE payment_intents
	ADD COLUMN amount_refunded INTEGER NOT NULL DEFAULT 0
	CHECK (amount_refunded BETWEEN 0 AND amount_received);

CREATE TABLE refunds (
	id             TEXT    NOT NULL PRIMARY KEY,
	account        TEXT    NOT NULL, -- that of its PaymentIntent
	payment_intent TEXT    NOT NULL REFERENCES payment_intents (id),
	amount         INTEGER NOT NULL CHECK (amount > 0),
	currency       TEXT    NOT NULL,
	status         TEXT    NOT NULL,
	reason         TEXT,
	metadata       TEXT    NOT NULL DEFAULT '{}', -- JSON object
	created        INTEGER NOT NULL, -- Unix seconds, as the API shows it
	-- When the row was written, Unix nanoseconds, for listing newest first
	-- (id breaks ties).
	created_at     INTEGER NOT NULL
) STRICT;

CREATE INDEX refunds_account_created ON refunds (account, created_at DESC, id DESC);
CREATE INDEX refunds_payment_intent_created ON refunds (payment_intent, created_at DESC, id DESC);
