package pgstore_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/storetest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestConformance runs the suite every idem.Store passes, each store on a
// schema of its own.
func TestConformance(t *testing.T) {
	var pools sync.Map // *pgstore.Store → *pgxpool.Pool
	newStore := func(t *testing.T, now func() time.Time) idem.Store {
		pool := migratedPool(t)
		s := pgstore.New(pool, pgstore.Options{Now: now})
		pools.Store(s, pool)
		t.Cleanup(func() { pools.Delete(s) })
		return s
	}
	storetest.Run(t, storetest.Harness{
		New:   func(t *testing.T) idem.Store { return newStore(t, nil) },
		NewAt: newStore,
		Write: func(ctx context.Context, tx idem.Tx, name string) error {
			_, err := idem.UnwrapTx(tx).(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, name)
			return err
		},
		Count: func(ctx context.Context, s idem.Store, name string) (int, error) {
			pool, _ := pools.Load(s)
			var n int
			err := pool.(*pgxpool.Pool).QueryRow(ctx, `SELECT count(*) FROM effects WHERE name = $1`, name).Scan(&n)
			return n, err
		},
	})
}
