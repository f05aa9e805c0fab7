-- Idempotency keys: one row per (user, key), claimed with
-- INSERT ... ON CONFLICT DO NOTHING and fenced on owner.
CREATE TABLE idempotency_keys (
    user_id         text        NOT NULL,
    key             text        NOT NULL,
    fingerprint     text        NOT NULL,
    method          text        NOT NULL,
    path            text        NOT NULL,
    request_header  jsonb,
    request_body    bytea,
    owner           text        NOT NULL,
    lease_until     timestamptz NOT NULL,
    attempts        int         NOT NULL DEFAULT 1,
    response_status int,
    response_header jsonb,
    response_body   bytea,
    created_at      timestamptz NOT NULL,
    completed_at    timestamptz,
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (user_id, key)
);

-- The cleaner deletes by expiry, oldest first.
CREATE INDEX idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);

-- The completer looks for records without a response whose lease ran out;
-- completed records, the vast majority, stay out of this index.
CREATE INDEX idempotency_keys_abandoned_idx ON idempotency_keys (lease_until)
    WHERE response_status IS NULL;
