-- The completer's re-drive budget lives in the store: redrives counts the
-- takeovers made by a completer (ClaimParams.Redrive), apart from attempts.
ALTER TABLE idempotency_keys ADD COLUMN redrives INTEGER NOT NULL DEFAULT 0;

-- The completer lists the uncompleted keys whose lease ended longest ago
-- first (Abandoned): the index serves that order to its last tie-break,
-- and holds redrives, so that keys given up or in their backoff are
-- skipped without reading their rows.
DROP INDEX idempotency_keys_pending;
CREATE INDEX idempotency_keys_abandoned ON idempotency_keys (lease_until, created_at, user_id, key, redrives)
    WHERE response_status IS NULL;
