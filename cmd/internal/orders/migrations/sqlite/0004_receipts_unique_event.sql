-- One receipt per event: the consumer's message ids expire after the key
-- TTL while stream ORDERS keeps its messages, so a replay older than the
-- TTL reaches the receipt function again; the unique index turns its
-- second insert into a no-op (AddReceipt finds the receipt written).
--
-- A database that already holds several receipts of one event (written by
-- such a replay before this version) keeps the earliest (created_at, then
-- id) in receipts; the others move, unchanged, to receipt_duplicates,
-- with the time of the move, for an operator to look at. Nothing else
-- reads that table.
CREATE TABLE receipt_duplicates (
    id          TEXT    NOT NULL PRIMARY KEY,
    order_id    TEXT    NOT NULL,
    event_id    TEXT    NOT NULL,
    user_id     TEXT    NOT NULL,
    total       INTEGER NOT NULL,
    currency    TEXT    NOT NULL,
    created_at  TEXT    NOT NULL,
    removed_at  TEXT    NOT NULL
);

INSERT INTO receipt_duplicates (id, order_id, event_id, user_id, total, currency, created_at, removed_at)
SELECT id, order_id, event_id, user_id, total, currency, created_at, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')
FROM (
    SELECT r.*, row_number() OVER (PARTITION BY event_id ORDER BY created_at, id) AS n
    FROM receipts r
)
WHERE n > 1;

DELETE FROM receipts WHERE id IN (SELECT id FROM receipt_duplicates);

CREATE UNIQUE INDEX receipts_event_id ON receipts (event_id);
