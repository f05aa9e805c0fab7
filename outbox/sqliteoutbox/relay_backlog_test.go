package sqliteoutbox_test

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/outbox/sqliteoutbox"
	"github.com/idem-go/idem/sqlitestore"
)

// TestSQLiteBacklogLetsClaimsIn: a relay draining a backlog chains its
// Takes, each holding SQLite's write lock while it publishes. A claim of
// the same process must get the lock between two Takes, within about one
// pass, and not poll SQLite's lock behind them (SQLite's busy handler
// sleeps up to 100ms between tries, while the relay begins its next Take
// within microseconds of its commit) until its busy timeout runs out.
func TestSQLiteBacklogLetsClaimsIn(t *testing.T) {
	ctx := context.Background()
	st, err := sqlitestore.Open(ctx, filepath.Join(t.TempDir(), "backlog.db"), sqlitestore.Options{BusyTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	tb := sqliteoutbox.New(st.DB())
	if err := tb.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	const backlog = 2000
	tx, err := st.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range backlog {
		if err := tb.Add(ctx, tx, outbox.Event{ID: fmt.Sprintf("e%04d", i), Subject: "s", OrderingKey: fmt.Sprintf("k%d", i%8)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}

	// The relay: batches of 4, each event taking 5ms to publish, so a
	// pass holds the write lock for about 20ms and the backlog lasts
	// about 10s, longer than the store's busy timeout.
	rctx, stop := context.WithCancel(ctx)
	var published atomic.Int64
	relayDone := make(chan error, 1)
	go func() {
		for rctx.Err() == nil {
			n, err := tb.Take(rctx, 4, func(context.Context, outbox.Event) error {
				published.Add(1)
				time.Sleep(5 * time.Millisecond)
				return nil
			})
			if err != nil && rctx.Err() == nil {
				relayDone <- err
				return
			}
			if n == 0 {
				break
			}
		}
		relayDone <- nil
	}()
	defer func() {
		stop()
		if err := <-relayDone; err != nil {
			t.Errorf("relay: %v", err)
		}
	}()
	for published.Load() == 0 {
		time.Sleep(time.Millisecond)
	}

	var slowest time.Duration
	for i := range 10 {
		start := time.Now()
		c, err := st.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: fmt.Sprintf("key-%d", i), Fingerprint: "fp", Method: http.MethodPost, Path: "/v1/orders"})
		took := time.Since(start)
		slowest = max(slowest, took)
		if err != nil {
			t.Fatalf("claim %d beside the draining relay (after %v, %d events published): %v", i, took, published.Load(), err)
		}
		if c.Lease == nil {
			t.Fatalf("claim %d: %+v, want a lease", i, c)
		}
		if err := st.Release(ctx, c.Lease); err != nil {
			t.Fatalf("release %d: %v", i, err)
		}
	}
	if left := backlog - published.Load(); left <= 0 {
		t.Fatalf("the backlog was drained before the claims ended: the relay did not compete with them")
	}
	t.Logf("10 claims beside the draining relay; the slowest waited %v", slowest)
}
