-- Receipts: what the receipts consumer writes for each orders.created
-- event it applies. id is random; order_id is NOT unique on purpose: the
-- consumer applies an event once through idem.Do, and the audit must be
-- able to see a second receipt if that ever failed. Text ids compare
-- byte-wise (COLLATE "C"), as in SQLite and in orders.
CREATE TABLE receipts (
    id          text COLLATE "C" NOT NULL,
    order_id    text COLLATE "C" NOT NULL,
    event_id    text COLLATE "C" NOT NULL,
    user_id     text COLLATE "C" NOT NULL,
    total       bigint      NOT NULL,
    currency    text        NOT NULL,
    created_at  timestamptz NOT NULL,
    CONSTRAINT receipts_pkey PRIMARY KEY (id)
);

CREATE INDEX receipts_order_id ON receipts (order_id);
