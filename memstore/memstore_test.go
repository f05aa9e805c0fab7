package memstore_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/storetest"
)

func TestConformance(t *testing.T) {
	// Every case of the suite uses its own effect names, so one map per
	// run of the suite keeps them apart.
	var mu sync.Mutex
	effects := map[string]int{}
	storetest.Run(t, storetest.Harness{
		New: func(t *testing.T) idem.Store { return memstore.New(memstore.Options{}) },
		NewAt: func(t *testing.T, now func() time.Time) idem.Store {
			return memstore.New(memstore.Options{Now: now})
		},
		Write: func(ctx context.Context, tx idem.Tx, name string) error {
			idemdriver.UnwrapTx(tx).(*memstore.Tx).OnCommit(func() {
				mu.Lock()
				defer mu.Unlock()
				effects[name]++
			})
			return nil
		},
		HandlerCommit: func(ctx context.Context) error {
			tx, err := memstore.FromContext(ctx)
			if err != nil {
				return err
			}
			return tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK})
		},
		HandlerRollback: func(ctx context.Context) error {
			tx, err := memstore.FromContext(ctx)
			if err != nil {
				return err
			}
			return tx.Rollback(ctx)
		},
		Count: func(ctx context.Context, s idem.Store, name string) (int, error) {
			mu.Lock()
			defer mu.Unlock()
			return effects[name], nil
		},
	})
}
