-- The gateway's ledger: one row per PaymentIntent, in the columns of
-- Stripe's object that the gateway uses.
CREATE TABLE payment_intents (
	id                   text        PRIMARY KEY,
	account              text        NOT NULL, -- AccountFor(the API key)
	amount               bigint      NOT NULL,
	amount_capturable    bigint      NOT NULL DEFAULT 0,
	amount_received      bigint      NOT NULL DEFAULT 0,
	currency             text        NOT NULL,
	status               text        NOT NULL,
	capture_method       text        NOT NULL DEFAULT '',
	confirmation_method  text        NOT NULL DEFAULT '',
	description          text,
	livemode             boolean     NOT NULL DEFAULT false,
	metadata             jsonb       NOT NULL DEFAULT '{}',
	payment_method       text        NOT NULL DEFAULT '',
	payment_method_types jsonb       NOT NULL DEFAULT '[]',
	last_payment_error   jsonb,
	created              bigint      NOT NULL, -- Unix seconds, as the API shows it
	-- When the row was written, for listing newest first (id breaks ties).
	created_at           timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE INDEX payment_intents_account_created ON payment_intents (account, created_at DESC, id DESC);
