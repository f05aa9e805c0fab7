package payments

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/sqlitestore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// testPool opens a pool for a gateway in schema with PostgresPool, closed
// when t ends.
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
	// keys reports how many idempotency records the store holds, expired
	// ones included.
	keys func(t *testing.T) int
	// restart closes the store and ledger and opens the same database
	// again, as a gateway that restarts does. Nil unless durable.
	restart func(t *testing.T) *backendDB
}

// backends are the three backends; the PostgreSQL one skips the test
// without a server (see pgtest.URL).
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
	st := memstore.New(memstore.Options{Now: now})
	return &backendDB{
		store:  st,
		ledger: l,
		count:  func(*testing.T) int { return l.Len() },
		keys:   func(*testing.T) int { return st.Len() },
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
		keys: func(t *testing.T) int {
			t.Helper()
			var n int
			if err := st.DB().QueryRow(`SELECT count(*) FROM idempotency_keys`).Scan(&n); err != nil {
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
	url, schema := pgtest.SchemaName(t) // OpenPostgres creates it
	pool := testPool(t, url, schema)
	ctx := context.Background()
	if _, _, err := OpenPostgres(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	return postgresDB(pgstore.New(pool, pgstore.Options{Now: now, Schema: schema}), NewPGLedger(pool, schema), pool, url, schema)
}

func postgresDB(st *pgstore.Store, l *PGLedger, pool *pgxpool.Pool, url, schema string) *backendDB {
	return &backendDB{
		store:  st,
		ledger: l,
		count: func(t *testing.T) int {
			t.Helper()
			var n int
			if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{schema, "payment_intents"}.Sanitize()).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		},
		keys: func(t *testing.T) int {
			t.Helper()
			var n int
			if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+pgx.Identifier{schema, "idempotency_keys"}.Sanitize()).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		},
		restart: func(t *testing.T) *backendDB {
			t.Helper()
			pool.Close()
			pool := testPool(t, url, schema)
			st, l, err := OpenPostgres(context.Background(), pool, schema)
			if err != nil {
				t.Fatal(err)
			}
			return postgresDB(st, l, pool, url, schema)
		},
	}
}
