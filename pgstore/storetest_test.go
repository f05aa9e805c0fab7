package pgstore_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/storetest"
	"github.com/jackc/pgx/v5"
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
		HandlerCommit:   func(ctx context.Context) error { return pgEnd(ctx, pgx.Tx.Commit) },
		HandlerRollback: func(ctx context.Context) error { return pgEnd(ctx, pgx.Tx.Rollback) },
		Count: func(ctx context.Context, s idem.Store, name string) (int, error) {
			pool, _ := pools.Load(s)
			var n int
			err := pool.(*pgxpool.Pool).QueryRow(ctx, `SELECT count(*) FROM effects WHERE name = $1`, name).Scan(&n)
			return n, err
		},
	})
}

// pgEnd calls end (pgx.Tx's Commit or Rollback) on the transaction that
// pgstore.FromContext gives the handler of ctx's request.
func pgEnd(ctx context.Context, end func(pgx.Tx, context.Context) error) error {
	tx, err := pgstore.FromContext(ctx)
	if err != nil {
		return err
	}
	return end(tx, ctx)
}
