package pgstore_test

import (
	"context"
	"net/http"
	"os"
	"testing"
	"testing/fstest"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
)

// A response completed before 0004 (no response_trailer column) stays
// readable after it: the same answer, without trailers.
func TestRowsBeforeTrailerMigrationStayReadable(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := context.Background()
	old := fstest.MapFS{}
	for _, name := range []string{"0001_idempotency_keys.sql", "0002_completed_expiry_index.sql", "0003_redrives.sql"} {
		b, err := os.ReadFile("migrations/" + name)
		if err != nil {
			t.Fatal(err)
		}
		old[name] = &fstest.MapFile{Data: b}
	}
	if err := pgstore.ApplyMigrations(ctx, pool, pgstore.Component, old); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `
INSERT INTO idempotency_keys
	(user_id, key, fingerprint, method, path, owner, lease_until, attempts,
	 response_status, response_header, response_body, created_at, completed_at, expires_at)
VALUES ('u', 'old', 'f', 'POST', '/v1/orders', 'o', now(), 1,
	201, '{"Content-Type": ["text/plain"]}', 'made', now(), now(), now() + interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	s := pgstore.New(pool, pgstore.Options{})
	c, err := s.Claim(ctx, params("u", "old", "f"))
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
