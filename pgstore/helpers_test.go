package pgstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/storetest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// testBundle is what a test needs besides its store.
type testBundle struct {
	pool  *pgxpool.Pool
	clock *storetest.Clock
}

// migratedPool returns a pool on a fresh schema with the store's tables and
// a table effects(name text) for the handlers' writes.
func migratedPool(t testing.TB, opts ...pgtest.PoolOption) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t, opts...)
	migrate(t, pool)
	return pool
}

// migrate creates the store's tables and effects(name text) in the schema
// pool's search_path selects.
func migrate(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (name text NOT NULL)`); err != nil {
		t.Fatalf("creating effects: %v", err)
	}
}

// setup returns a store on a fresh, migrated schema (see migratedPool) with
// a fake clock.
func setup(t *testing.T) (*pgstore.Store, *testBundle) {
	t.Helper()
	pool := migratedPool(t)
	clock := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	return pgstore.New(pool, pgstore.Options{Now: clock.Now}), &testBundle{pool: pool, clock: clock}
}
