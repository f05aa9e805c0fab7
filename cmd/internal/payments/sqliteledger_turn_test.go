package payments

import (
	"context"
	"fmt"
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/sqlitestore"
)

// TestSQLiteLedgerCreateWithoutRequestTakesItsTurn: a PaymentIntent
// written outside an idempotent request (a charge without an
// Idempotency-Key: the gateway's keys are optional) waits in the pool's
// write queue with the store's claims and request transactions, and is
// written in its turn. Past the queue it polls SQLite's write lock with
// sleeps of up to 100ms, while the queued writers hand the lock to each
// other within microseconds: under steady keyed traffic it never finds
// the lock free and fails with SQLITE_BUSY once the busy timeout ran out.
//
// The store keeps its default busy timeout (10 s). The traffic never
// stops, so the old starvation fails with any timeout, only later. A 2 s
// timeout made the test fail under CPU load for another reason: the
// queue itself (8 writers holding the lock 20 ms each, plus the race
// detector and a loaded machine's scheduling per turn) once kept a keyed
// writer waiting over 2 s (a clean-clone CI run, 2026-12-05).
func TestSQLiteLedgerCreateWithoutRequestTakesItsTurn(t *testing.T) {
	ctx := context.Background()
	st, err := sqlitestore.Open(ctx, filepath.Join(t.TempDir(), "payments.db"), sqlitestore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if err := MigrateSQLite(ctx, st.DB()); err != nil {
		t.Fatal(err)
	}
	l := NewSQLiteLedger(st.DB())

	// Steady keyed traffic: each of 8 writers claims a key, holds its
	// request's transaction for 20ms (the handler's writes), and
	// completes; one in the queue waits about 8·20ms for its turn.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				if err := keyedRequest(ctx, st, fmt.Sprintf("k%d-%d", w, i)); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	defer func() {
		close(stop)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Errorf("keyed request: %v", err)
		}
	}()
	time.Sleep(50 * time.Millisecond) // the traffic is steady

	for i := range 3 {
		start := time.Now()
		if err := l.Create(ctx, newPI("acct_unkeyed", i)); err != nil {
			t.Fatalf("Create %d without a request, beside keyed traffic (after %v): %v", i, time.Since(start), err)
		}
	}
}

// keyedRequest is what the gateway's middleware does for one request
// with a new key: claim it, write in its transaction, complete it.
func keyedRequest(ctx context.Context, st *sqlitestore.Store, key string) error {
	c, err := st.Claim(ctx, idemdriver.ClaimParams{User: "acct_keyed", Key: key, Fingerprint: "fp", Method: http.MethodPost, Path: "/v1/payment_intents"})
	if err != nil {
		return fmt.Errorf("claim %s: %w", key, err)
	}
	tx, err := st.Begin(ctx, c.Lease)
	if err != nil {
		return fmt.Errorf("begin %s: %w", key, err)
	}
	time.Sleep(20 * time.Millisecond)
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK}); err != nil {
		return fmt.Errorf("complete %s: %w", key, err)
	}
	return nil
}
