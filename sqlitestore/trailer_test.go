package sqlitestore_test

import (
	"context"
	"database/sql"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"testing/fstest"
	"time"

	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/sqlitestore"
)

// A response completed before 0004 (no response_trailer column) stays
// readable after it: the same answer, without trailers.
func TestRowsBeforeTrailerMigrationStayReadable(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "old.db")
	db, err := sql.Open("sqlite", path)
	if err != nil {
		t.Fatal(err)
	}
	old := fstest.MapFS{}
	for _, name := range []string{"0001_idempotency_keys.sql", "0002_completed_expiry_index.sql", "0003_redrives.sql"} {
		b, err := os.ReadFile("migrations/" + name)
		if err != nil {
			t.Fatal(err)
		}
		old[name] = &fstest.MapFile{Data: b}
	}
	if err := sqlitestore.ApplyMigrations(ctx, db, sqlitestore.Component, old); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if _, err := db.ExecContext(ctx, `
		INSERT INTO idempotency_keys (user_id, key, fingerprint, method, path, request_header, owner, lease_until, attempts,
			response_status, response_header, response_body, created_at, completed_at, expires_at)
		VALUES ('u', 'old', 'f', 'POST', '/v1/orders', 'null', 'o', ?, 1, 201, '{"Content-Type":["text/plain"]}', X'6d616465', ?, ?, ?)`,
		now.UnixNano(), now.UnixNano(), now.UnixNano(), now.Add(time.Hour).UnixNano()); err != nil {
		t.Fatal(err)
	}
	db.Close()
	s, err := sqlitestore.Open(ctx, path, sqlitestore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c, err := s.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: "old", Fingerprint: "f", Method: "POST", Path: "/v1/orders"})
	if err != nil || c.Response == nil {
		t.Fatalf("Claim = %+v, %v; want the stored response", c, err)
	}
	if r := c.Response; r.Status != http.StatusCreated || string(r.Body) != "made" ||
		r.Header.Get("Content-Type") != "text/plain" || r.Trailer != nil {
		t.Errorf("replay = %+v; want 201 text/plain made, no trailers", r)
	}
	rec, err := s.Get(ctx, "u", "old")
	if err != nil || rec.Response == nil || rec.Response.Trailer != nil || string(rec.Response.Body) != "made" {
		t.Errorf("Get = %+v, %v", rec, err)
	}
}
