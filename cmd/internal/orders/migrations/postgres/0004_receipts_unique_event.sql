-- One receipt per event: the consumer's message ids expire after the key
-- TTL while stream ORDERS keeps its messages, so a replay older than the
-- TTL reaches the receipt function again; the unique index turns its
-- second insert into a no-op (AddReceipt finds the receipt written).
--
-- A database that already holds several receipts of one event (written by
-- such a replay before this version) keeps the earliest (created_at, then
-- id) in receipts; the others move, unchanged, to receipt_duplicates,
-- with the time of the move, for an operator to look at. Nothing else
-- reads that table. Writers of receipts wait for the end of this
-- migration (the lock), so that none slips a duplicate in between the
-- move and the index.
LOCK TABLE receipts IN SHARE ROW EXCLUSIVE MODE;

CREATE TABLE receipt_duplicates (
    id          text COLLATE "C" NOT NULL,
    order_id    text COLLATE "C" NOT NULL,
    event_id    text COLLATE "C" NOT NULL,
    user_id     text COLLATE "C" NOT NULL,
    total       bigint      NOT NULL,
    currency    text        NOT NULL,
    created_at  timestamptz NOT NULL,
    removed_at  timestamptz NOT NULL,
    CONSTRAINT receipt_duplicates_pkey PRIMARY KEY (id)
);

INSERT INTO receipt_duplicates (id, order_id, event_id, user_id, total, currency, created_at, removed_at)
SELECT id, order_id, event_id, user_id, total, currency, created_at, now()
FROM (
    SELECT r.*, row_number() OVER (PARTITION BY event_id ORDER BY created_at, id) AS n
    FROM receipts r
) d
WHERE d.n > 1;

DELETE FROM receipts r USING receipt_duplicates d WHERE r.id = d.id;

CREATE UNIQUE INDEX receipts_event_id ON receipts (event_id);
