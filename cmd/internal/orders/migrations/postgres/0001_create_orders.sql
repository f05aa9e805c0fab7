-- Orders. Times are timestamptz (microsecond precision: the service
-- truncates them before writing). items is the JSON array of the order's
-- items. id and user_id compare byte-wise (COLLATE "C"), as in SQLite, so
-- that pages and audits come out in the same order on both databases.
CREATE TABLE orders (
    id                          text COLLATE "C" NOT NULL,
    user_id                     text COLLATE "C" NOT NULL,
    status                      text        NOT NULL,
    items                       jsonb       NOT NULL,
    total                       bigint      NOT NULL,
    currency                    text        NOT NULL,
    payment_id                  text        NOT NULL,
    -- The Idempotency-Key of the request that made the order (NULL without
    -- one) and when its idempotency record was created: a key that expired
    -- names a new operation, so both make the order's operation unique.
    idempotency_key             text,
    idempotency_key_created_at  timestamptz,
    created_at                  timestamptz NOT NULL,
    CONSTRAINT orders_pkey PRIMARY KEY (id)
);

-- NULLs are distinct: orders without a key never collide on it.
CREATE UNIQUE INDEX orders_user_id_idempotency_key
    ON orders (user_id, idempotency_key, idempotency_key_created_at);

-- Listing (newest first, keyset on created_at, id) and the audit's scan.
CREATE INDEX orders_user_id_created_at_id ON orders (user_id, created_at, id);
