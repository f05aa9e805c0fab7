package pgstore_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// defaultCIDatabaseURL is where CI runs its PostgreSQL.
const defaultCIDatabaseURL = "postgres://root@127.0.0.1:5432/test"

// databaseURL returns the server the tests use: TEST_DATABASE_URL, or
// under CI=true the CI server. Elsewhere, without TEST_DATABASE_URL, the
// test is skipped.
func databaseURL(t testing.TB) string {
	t.Helper()
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return u
	}
	if os.Getenv("CI") == "true" {
		return defaultCIDatabaseURL
	}
	t.Skip("pgstore: set TEST_DATABASE_URL (for example " + defaultCIDatabaseURL + ") to run the PostgreSQL tests")
	return ""
}

// testSchema creates a schema of its own for t, dropped when t ends, and
// returns a pool whose connections use it. The schema is not migrated.
func testSchema(t testing.TB) *pgxpool.Pool {
	t.Helper()
	url := databaseURL(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var b [8]byte
	rand.Read(b[:])
	schema := "t_" + hex.EncodeToString(b[:])

	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connecting to %s: %v", url, err)
	}
	_, err = admin.Exec(ctx, "CREATE SCHEMA "+schema)
	admin.Close(ctx)
	if err != nil {
		t.Fatalf("creating schema %s: %v", schema, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		admin, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Errorf("dropping schema %s: %v", schema, err)
			return
		}
		defer admin.Close(ctx)
		if _, err := admin.Exec(ctx, "DROP SCHEMA "+schema+" CASCADE"); err != nil {
			t.Errorf("dropping schema %s: %v", schema, err)
		}
	})

	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("parsing %s: %v", url, err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	// Tests run in parallel against one server: keep each one's share of
	// its connections small.
	cfg.MaxConns = 6
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("pool: %v", err)
	}
	t.Cleanup(pool.Close) // runs before the schema is dropped
	return pool
}

// testBundle is what a test needs besides its store.
type testBundle struct {
	pool  *pgxpool.Pool
	clock *fakeClock
}

// setup returns a store on a fresh, migrated schema with a fake clock, and
// a table effects(name text) for the handlers' writes.
func setup(t *testing.T) (*pgstore.Store, *testBundle) {
	t.Helper()
	pool := testSchema(t)
	ctx := context.Background()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (name text NOT NULL)`); err != nil {
		t.Fatalf("creating effects: %v", err)
	}
	clock := &fakeClock{t: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)}
	return pgstore.New(pool, pgstore.Options{Now: clock.Now}), &testBundle{pool: pool, clock: clock}
}

// fakeClock is a clock that moves only when told.
type fakeClock struct {
	mu sync.Mutex // guards t
	t  time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}
