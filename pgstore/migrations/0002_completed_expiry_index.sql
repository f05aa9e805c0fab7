-- Only completed records expire (a record without a response is kept
-- until its attempt or the completer finishes it, whatever its TTL), so
-- the cleaner's index holds only completed records: records without a
-- response that outlived their TTL are not scanned again by every batch.
-- Building it locks the table against writes while it runs (migrations run
-- in one transaction); on a large table, create it beforehand with
-- CREATE INDEX CONCURRENTLY under the same name: IF NOT EXISTS skips it.
CREATE INDEX IF NOT EXISTS idempotency_keys_completed_expires_at_idx ON idempotency_keys (expires_at)
    WHERE response_status IS NOT NULL;

DROP INDEX IF EXISTS idempotency_keys_expires_at_idx;
