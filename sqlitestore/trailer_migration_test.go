package sqlitestore_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/idem-go/idem/idemdriver"
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
	ctx := context.Background()
	s, clk := clocked(t)
	db := s.DB()

	// A new instance completes operation 1 with a trailer.
	p := params("u", "k", "fp1")
	p.TTL = time.Hour
	l := lease(t, s, p)
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{
		Status:  http.StatusCreated,
		Header:  http.Header{"Content-Type": {"text/plain"}},
		Body:    []byte("op1"),
		Trailer: http.Header{"X-Receipt": {"receipt-of-op1"}},
	}); err != nil {
		t.Fatal(err)
	}

	// The key expires; an old instance starts operation 2 on it...
	clk.Advance(2 * time.Hour)
	now := clk.Now().UnixNano()
	var oldOwner string
	if err := db.QueryRowContext(ctx, `SELECT owner FROM idempotency_keys WHERE user_id = 'u' AND key = 'k'`).Scan(&oldOwner); err != nil {
		t.Fatal(err)
	}
	header, err := json.Marshal(http.Header(nil))
	if err != nil {
		t.Fatal(err)
	}
	res, err := db.ExecContext(ctx, `
				UPDATE idempotency_keys SET fingerprint = ?, method = ?, path = ?, request_header = ?, request_body = ?,
					owner = ?, lease_until = ?, attempts = 1, redrives = 0,
					response_status = NULL, response_header = NULL, response_body = NULL,
					created_at = ?, completed_at = NULL, expires_at = ?
				WHERE user_id = ? AND key = ? AND owner = ? AND response_status IS NOT NULL`,
		"fp2", http.MethodPost, "/v1/orders", string(header), []byte(`{}`),
		"old-owner", now+int64(30*time.Second), now, now+int64(time.Hour),
		"u", "k", oldOwner)
	if n, _ := rowsAffected(res, err); err != nil || n != 1 {
		t.Fatalf("old replace: %v, %d rows", err, n)
	}
	// The trigger cleared the trailers with the response.
	var trailerNull bool
	if err := db.QueryRowContext(ctx, `SELECT response_trailer IS NULL FROM idempotency_keys WHERE user_id = 'u' AND key = 'k'`).Scan(&trailerNull); err != nil || !trailerNull {
		t.Errorf("after the old replace: response_trailer IS NULL = %v, %v; want true", trailerNull, err)
	}
	// ...and completes it (old Complete: no trailer column).
	res, err = db.ExecContext(ctx, `
			UPDATE idempotency_keys
			SET response_status = ?, response_header = ?, response_body = ?, completed_at = ?,
				expires_at = CASE WHEN expires_at <= ? THEN ? + (expires_at - created_at) ELSE expires_at END
			WHERE user_id = ? AND key = ? AND owner = ? AND response_status IS NULL`,
		http.StatusCreated, `{"Content-Type":["text/plain"]}`, []byte("op2"), now, now, now,
		"u", "k", "old-owner")
	if n, _ := rowsAffected(res, err); err != nil || n != 1 {
		t.Fatalf("old complete: %v, %d rows", err, n)
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
	rec, err := s.Get(ctx, "u", "k")
	if err != nil || rec.Response == nil || rec.Response.Trailer != nil {
		t.Errorf("Get = %+v, %v; want operation 2's response without trailers", rec, err)
	}

	// A new instance's own completion keeps its trailers: the trigger
	// fires only when response_status goes from a value to NULL.
	clk.Advance(2 * time.Hour)
	p3 := params("u", "k", "fp3")
	l = lease(t, s, p3)
	if tx, err = s.Begin(ctx, l); err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK, Body: []byte("op3"),
		Trailer: http.Header{"X-Receipt": {"receipt-of-op3"}}}); err != nil {
		t.Fatal(err)
	}
	c, err = s.Claim(ctx, p3)
	if err != nil || c.Response == nil || c.Response.Trailer.Get("X-Receipt") != "receipt-of-op3" {
		t.Errorf("replay of operation 3 = %+v, %v; want its trailer", c.Response, err)
	}
}

func rowsAffected(res sql.Result, err error) (int64, error) {
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}
