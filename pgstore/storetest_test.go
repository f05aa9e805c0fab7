package pgstore_test

import (
	"context"
	"sync"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/storetest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestConformance runs the suite every idem.Store passes, each store on a
// schema of its own with the real clock.
func TestConformance(t *testing.T) {
	var pools sync.Map // *pgstore.Store → *pgxpool.Pool
	storetest.Run(t, storetest.Harness{
		New: func(t *testing.T) idem.Store {
			pool := testSchema(t)
			ctx := context.Background()
			if err := pgstore.Migrate(ctx, pool); err != nil {
				t.Fatalf("Migrate: %v", err)
			}
			if _, err := pool.Exec(ctx, `CREATE TABLE storetest_effects (name text NOT NULL)`); err != nil {
				t.Fatalf("creating storetest_effects: %v", err)
			}
			s := pgstore.New(pool, pgstore.Options{})
			pools.Store(s, pool)
			t.Cleanup(func() { pools.Delete(s) })
			return s
		},
		Write: func(ctx context.Context, tx idem.Tx, name string) error {
			_, err := tx.(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO storetest_effects (name) VALUES ($1)`, name)
			return err
		},
		Count: func(ctx context.Context, s idem.Store, name string) (int, error) {
			pool, _ := pools.Load(s)
			var n int
			err := pool.(*pgxpool.Pool).QueryRow(ctx, `SELECT count(*) FROM storetest_effects WHERE name = $1`, name).Scan(&n)
			return n, err
		},
	})
}
