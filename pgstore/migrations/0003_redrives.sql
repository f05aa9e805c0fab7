-- The completer's re-drive count moves into the store: a takeover by a
-- completer (ClaimParams.Redrive) counts here, apart from the clients'
-- attempts, so every completer shares one budget and one backoff.
-- PostgreSQL 11 and later add a column with a constant default without
-- rewriting the table.
ALTER TABLE idempotency_keys ADD COLUMN redrives integer NOT NULL DEFAULT 0;

-- Abandoned lists the records without a response by lease end, then
-- creation, user and key: this index gives that order, so a batch reads
-- only the keys it returns (and the ones it leaves out, given up or in
-- their backoff) instead of sorting every record without a response.
-- Completed records, the vast majority, stay out of it. Building it locks
-- the table against writes while it runs (migrations run in one
-- transaction); on a large table, create it beforehand with
-- CREATE INDEX CONCURRENTLY under the same name: IF NOT EXISTS skips it.
CREATE INDEX IF NOT EXISTS idempotency_keys_abandoned_order_idx
    ON idempotency_keys (lease_until, created_at, user_id, key)
    WHERE response_status IS NULL;

DROP INDEX IF EXISTS idempotency_keys_abandoned_idx;
