-- Orders. Times are UTC RFC 3339 text with nine fractional digits, so that
-- they sort as text. items is the JSON array of the order's items.
CREATE TABLE orders (
    id                          TEXT    NOT NULL PRIMARY KEY,
    user_id                     TEXT    NOT NULL,
    status                      TEXT    NOT NULL,
    items                       TEXT    NOT NULL,
    total                       INTEGER NOT NULL,
    currency                    TEXT    NOT NULL,
    payment_id                  TEXT    NOT NULL,
    -- The Idempotency-Key of the request that made the order (NULL without
    -- one) and when its idempotency record was created: a key that expired
    -- names a new operation, so both make the order's operation unique.
    idempotency_key             TEXT,
    idempotency_key_created_at  TEXT,
    created_at                  TEXT    NOT NULL
);

CREATE UNIQUE INDEX orders_user_id_idempotency_key
    ON orders (user_id, idempotency_key, idempotency_key_created_at);

CREATE INDEX orders_user_id_created_at_id ON orders (user_id, created_at, id);
