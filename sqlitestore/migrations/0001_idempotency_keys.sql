-- Idempotency records, one per (user_id, key). Times are Unix nanoseconds.
-- response_status is NULL until the key completes; owner is the fencing
-- token of the attempt that holds (or last held) the lease.
CREATE TABLE idempotency_keys (
    user_id         TEXT    NOT NULL,
    key             TEXT    NOT NULL,
    fingerprint     TEXT    NOT NULL,
    method          TEXT    NOT NULL,
    path            TEXT    NOT NULL,
    request_header  TEXT    NOT NULL, -- JSON of http.Header
    request_body    BLOB,
    owner           TEXT    NOT NULL,
    lease_until     INTEGER NOT NULL,
    attempts        INTEGER NOT NULL,
    response_status INTEGER,
    response_header TEXT,             -- JSON of http.Header
    response_body   BLOB,
    created_at      INTEGER NOT NULL,
    completed_at    INTEGER,
    expires_at      INTEGER NOT NULL,
    PRIMARY KEY (user_id, key)
) STRICT;

-- The cleaner deletes by expiry.
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);

-- The completer lists uncompleted keys, oldest first.
CREATE INDEX idempotency_keys_pending ON idempotency_keys (created_at)
    WHERE response_status IS NULL;
