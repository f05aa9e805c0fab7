-- Refunds: one row per refund, and on each PaymentIntent how much of it
-- was refunded, which never exceeds what it received.
ALTER TABLE payment_intents
	ADD COLUMN amount_refunded bigint NOT NULL DEFAULT 0,
	ADD CONSTRAINT payment_intents_refund_within CHECK (amount_refunded BETWEEN 0 AND amount_received);

CREATE TABLE refunds (
	id             text        PRIMARY KEY,
	account        text        NOT NULL, -- that of its PaymentIntent
	payment_intent text        NOT NULL REFERENCES payment_intents (id),
	amount         bigint      NOT NULL CHECK (amount > 0),
	currency       text        NOT NULL,
	status         text        NOT NULL,
	reason         text,
	metadata       jsonb       NOT NULL DEFAULT '{}',
	created        bigint      NOT NULL, -- Unix seconds, as the API shows it
	-- When the row was written, for listing newest first (id breaks ties).
	created_at     timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX refunds_account_created ON refunds (account, created_at DESC, id DESC);
CREATE INDEX refunds_payment_intent_created ON refunds (payment_intent, created_at DESC, id DESC);
