-- Receipts: what the receipts consumer writes for each orders.created
-- event it applies. id is random; order_id is NOT unique on purpose: the
-- consumer applies an event once through idem.Do, and the audit must be
-- able to see a second receipt if that ever failed. Times as in orders.
CREATE TABLE receipts (
    id          TEXT    NOT NULL PRIMARY KEY,
    order_id    TEXT    NOT NULL,
    event_id    TEXT    NOT NULL,
    user_id     TEXT    NOT NULL,
    total       INTEGER NOT NULL,
    currency    TEXT    NOT NULL,
    created_at  TEXT    NOT NULL
);

CREATE INDEX receipts_order_id ON receipts (order_id);
