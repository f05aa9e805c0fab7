package payments

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/sqlitestore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// defaultCIDatabaseURL is where CI runs its PostgreSQL.
const defaultCIDatabaseURL = "postgres://root@127.0.0.1:5432/test"

// testDatabaseURL returns the PostgreSQL server the tests use:
// TEST_DATABASE_URL, or under CI=true the CI server. Elsewhere, without
// TEST_DATABASE_URL, the test is skipped.
func testDatabaseURL(t testing.TB) string {
	t.Helper()
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return u
	}
	if os.Getenv("CI") == "true" {
		return defaultCIDatabaseURL
	}
	t.Skip("payments: set TEST_DATABASE_URL (for example " + defaultCIDatabaseURL + ") to run the PostgreSQL tests")
	return ""
}

// testSchema returns the server's URL and the name of a schema of t's own,
// which PostgresPool creates and which is dropped when t ends.
func testSchema(t testing.TB) (url, schema string) {
	t.Helper()
	url = testDatabaseURL(t)
	var b [8]byte
	rand.Read(b[:])
	schema = "t_" + hex.EncodeToString(b[:])
	t.Cleanup(func() { // runs after the pools' cleanups: registered first
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			t.Errorf("dropping schema %s: %v", schema, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
			t.Errorf("dropping schema %s: %v", schema, err)
		}
	})
	return url, schema
}

// testPool opens a pool on schema with PostgresPool, closed when t ends.
func testPool(t testing.TB, url, schema string) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := PostgresPool(ctx, url, schema)
	if err != nil {
		t.Fatalf("PostgresPool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// testBackend is a way to keep a gateway's idempotency keys and PaymentIntents.
type testBackend struct {
	name    string
	durable bool // survives a restart
	// open returns an empty store and ledger that commit together, on a
	// database of t's own; the store's clock is now (nil: time.Now).
	open func(t *testing.T, now func() time.Time) *backendDB
}

// backendDB is one open backend.
type backendDB struct {
	store  idem.Store
	ledger Ledger
	// count reports how many PaymentIntents the ledger holds, every
	// account.
	count func(t *testing.T) int
	// restart closes the store and ledger and opens the same database
	// again, as a gateway that restarts does. Nil unless durable.
	restart func(t *testing.T) *backendDB
}

// backends are the three backends; the PostgreSQL one skips the test
// without a server (see testDatabaseURL).
var backends = []testBackend{
	{name: "memory", open: openMemory},
	{name: "sqlite", durable: true, open: openSQLiteBackend},
	{name: "postgres", durable: true, open: openPostgresBackend},
}

// forEachBackend runs f in a subtest per backend.
func forEachBackend(t *testing.T, f func(t *testing.T, be testBackend)) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) { f(t, be) })
	}
}

func openMemory(t *testing.T, now func() time.Time) *backendDB {
	l := NewMemLedger()
	return &backendDB{
		store:  memstore.New(memstore.Options{Now: now}),
		ledger: l,
		count:  func(*testing.T) int { return l.Len() },
	}
}

func openSQLiteBackend(t *testing.T, now func() time.Time) *backendDB {
	t.Helper()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "payments.db")
	st, err := sqlitestore.Open(ctx, path, sqlitestore.Options{Now: now})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if err := MigrateSQLite(ctx, st.DB()); err != nil {
		t.Fatal(err)
	}
	return sqliteDB(st, NewSQLiteLedger(st.DB()), path)
}

func sqliteDB(st *sqlitestore.Store, l *SQLiteLedger, path string) *backendDB {
	return &backendDB{
		store:  st,
		ledger: l,
		count: func(t *testing.T) int {
			t.Helper()
			var n int
			if err := st.DB().QueryRow(`SELECT count(*) FROM payment_intents`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		},
		restart: func(t *testing.T) *backendDB {
			t.Helper()
			if err := st.Close(); err != nil {
				t.Fatal(err)
			}
			st, l, err := OpenSQLite(context.Background(), path)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			return sqliteDB(st, l, path)
		},
	}
}

func openPostgresBackend(t *testing.T, now func() time.Time) *backendDB {
	t.Helper()
	url, schema := testSchema(t)
	pool := testPool(t, url, schema)
	ctx := context.Background()
	if _, _, err := OpenPostgres(ctx, pool); err != nil {
		t.Fatal(err)
	}
	return postgresDB(pgstore.New(pool, pgstore.Options{Now: now}), NewPGLedger(pool), pool, url, schema)
}

func postgresDB(st *pgstore.Store, l *PGLedger, pool *pgxpool.Pool, url, schema string) *backendDB {
	return &backendDB{
		store:  st,
		ledger: l,
		count: func(t *testing.T) int {
			t.Helper()
			var n int
			if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM payment_intents`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		},
		restart: func(t *testing.T) *backendDB {
			t.Helper()
			pool.Close()
			pool := testPool(t, url, schema)
			st, l, err := OpenPostgres(context.Background(), pool)
			if err != nil {
				t.Fatal(err)
			}
			return postgresDB(st, l, pool, url, schema)
		},
	}
}
