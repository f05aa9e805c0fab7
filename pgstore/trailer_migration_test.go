package pgstore_test

import (
	"context"
	"net/http"
	"testing"
	"time"
)

// A rolling deploy: new instances have run 0004 and store trailers in
// response_trailer, old instances (before d9ea8a4) still serve. An old
// instance replaces an expired completed key (its replace sets
// response_status/header/body to NULL but knows nothing of
// response_trailer) and then completes the new operation without writing
// the column. Migration 0005's trigger clears response_trailer when
// response_status goes from a value to NULL, so the new instances replay
// the new answer without the previous operation's trailers. The statements
// below are the old instance's, verbatim from d23252a.
func TestOldInstanceReplaceClearsTrailers(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()

	// A new instance completes operation 1 with a trailer.
	p := params("u", "k", "fp1")
	p.TTL = time.Hour
	l := lease(t, s, p)
	tx := begin(t, s, l, "op1")
	resp1 := response("op1")
	resp1.Trailer = http.Header{"X-Receipt": {"receipt-of-op1"}}
	if err := tx.Complete(ctx, resp1); err != nil {
		t.Fatal(err)
	}

	// The key expires; an old instance starts operation 2 on it...
	b.clock.Advance(2 * time.Hour)
	now := b.clock.Now()
	var oldOwner string
	if err := b.pool.QueryRow(ctx, `SELECT owner FROM idempotency_keys WHERE user_id = 'u' AND key = 'k'`).Scan(&oldOwner); err != nil {
		t.Fatal(err)
	}
	tag, err := b.pool.Exec(ctx, `
UPDATE idempotency_keys
SET fingerprint = $4, method = $5, path = $6, request_header = $7, request_body = $8,
	owner = $9, lease_until = c.now + $10::interval, attempts = 1, redrives = 0,
	response_status = NULL, response_header = NULL, response_body = NULL,
	created_at = c.now, completed_at = NULL, expires_at = c.now + $11::interval
FROM (SELECT coalesce($12::timestamptz, statement_timestamp()) AS now) c
WHERE user_id = $1 AND key = $2 AND owner = $3
	AND response_status IS NOT NULL AND expires_at <= c.now`,
		"u", "k", oldOwner, "fp2", "POST", "/v1/orders", nil, []byte(`{}`),
		"old-owner", 30*time.Second, time.Hour, now)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("old replace: %v, %d rows", err, tag.RowsAffected())
	}
	// ...and completes it (old Complete: no trailer column).
	tag, err = b.pool.Exec(ctx, `
UPDATE idempotency_keys
SET response_status = $4, response_header = $5, response_body = $6, completed_at = c.now,
	expires_at = CASE WHEN expires_at > c.now THEN expires_at
		ELSE c.now + interval '1 microsecond' * (extract(epoch FROM expires_at - created_at) * 1000000) END
FROM (SELECT coalesce($7::timestamptz, statement_timestamp()) AS now) c
WHERE user_id = $1 AND key = $2 AND owner = $3 AND response_status IS NULL`,
		"u", "k", "old-owner", http.StatusCreated, []byte(`{"Content-Type":["text/plain"]}`), []byte("op2"), now)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("old complete: %v, %d rows", err, tag.RowsAffected())
	}

	// A new instance replays operation 2.
	c, err := s.Claim(ctx, params("u", "k", "fp2"))
	if err != nil || c.Response == nil {
		t.Fatalf("Claim: %+v, %v", c, err)
	}
	if string(c.Response.Body) != "op2" {
		t.Fatalf("body %q, want op2", c.Response.Body)
	}
	if c.Response.Trailer != nil {
		t.Errorf("operation 2's replay carries trailers %v, which operation 1 sent", c.Response.Trailer)
	}
}
