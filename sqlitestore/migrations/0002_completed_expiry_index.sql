-- Only completed records expire: the cleaner deletes completed records by
-- expiry, and never a record without a response.
DROP INDEX idempotency_keys_expires_at;
CREATE INDEX idempotency_keys_completed_expires_at ON idempotency_keys (expires_at)
    WHERE response_status IS NOT NULL;
