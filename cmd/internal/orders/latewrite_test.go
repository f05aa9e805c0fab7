package orders

// Regression tests from the ninth adversarial review of issue 8.

// Tests from the ninth adversarial review of issue 8.

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
)

// TestLateWriteAfterSettleRefused checks that an order write a handler's
// goroutine makes after the request was settled is refused, not committed
// outside the request's transaction.
//
// Review 9, finding: once the middleware has settled a request,
// TxFromContext answers an error that matches idem.ErrNoTx. But ErrNoTx is
// what this service's repositories (and the gateway's ledgers) read as
// "not an idempotent request": PostgresRepository.Create then writes the
// order with a statement of its own, which commits at once. So the late
// goroutine the eighth review's fix was meant to defuse no longer leaves
// an orphan transaction that never commits: its order commits outside
// the request's transaction, after the request was answered 5xx and
// nothing was stored (invariant 3: a stored response and its order commit
// together or not at all). The key stays bound with no answer; its retry
// runs the handler again against an order already written.
func TestLateWriteAfterSettleRefused(t *testing.T) {
	ctx := context.Background()
	pool := pgPool(t)
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if err := MigratePostgres(ctx, pool); err != nil {
		t.Fatal(err)
	}
	store := pgstore.New(pool, pgstore.Options{})
	repo := NewPostgresRepository(pool, pgstore.FromContext)

	answered := make(chan struct{})
	late := make(chan error, 1)
	h := idem.Middleware(store, idem.Options{User: func(*http.Request) string { return "alice" }})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rctx := r.Context()
		lease, _ := idem.LeaseFromContext(rctx)
		go func() {
			// The handler's worker, which outlived the handler (it gave up
			// waiting and answered 503).
			<-answered
			now := time.Now().UTC().Truncate(time.Microsecond)
			late <- repo.Create(rctx, &Order{
				ID: "ord_late", UserID: "alice", Status: "paid", Items: []Item{{SKU: "sku-1", Quantity: 1, UnitPrice: 100}},
				Total: 100, Currency: "usd", PaymentID: "pi_late", CreatedAt: now,
				IdempotencyKey: lease.Key, KeyCreatedAt: lease.CreatedAt,
			})
		}()
		http.Error(w, "upstream timed out", http.StatusServiceUnavailable)
	}))

	req := httptest.NewRequest(http.MethodPost, "/v1/orders", strings.NewReader(`{"a":1}`))
	req.Header.Set("Idempotency-Key", "k-late")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusServiceUnavailable {
		t.Fatalf("first answer %d %s", rec.Code, rec.Body)
	}
	close(answered)
	err := <-late
	t.Logf("late Create: %v (matches idem.ErrNoTx: %v)", err, errors.Is(err, idem.ErrNoTx))

	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	var stored bool
	if err := pool.QueryRow(ctx, `SELECT response_status IS NOT NULL FROM idempotency_keys WHERE key = 'k-late'`).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("a write the handler's goroutine made after the request was answered 503 committed %d order(s) outside the request's transaction (key's answer stored: %v); want it refused", n, stored)
	}
}
