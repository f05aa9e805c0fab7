package payments

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
)

// TestLatePaymentAfterSettleRefused checks that a payment a gateway
// handler's goroutine records after the request was settled is refused,
// not committed outside the request's transaction.
//
// Review 9, finding: after the middleware settles a request, TxFromContext
// answers an error matching idem.ErrNoTx, which PGLedger.Create reads as
// "no idempotent request" and so writes the PaymentIntent through the pool,
// committing it at once. A gateway handler's late worker thus records a
// payment after the request was answered 5xx with nothing stored: the
// client's retry of the key runs again and pays a second time.
func TestLatePaymentAfterSettleRefused(t *testing.T) {
	b := openPostgresBackend(t, time.Now)
	answered := make(chan struct{})
	late := make(chan error, 1)
	h := idem.Middleware(b.store, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rctx := r.Context()
		go func() {
			<-answered
			late <- b.ledger.Create(rctx, &PaymentIntent{
				ID: "pi_late", Object: "payment_intent", Amount: 100, AmountReceived: 100, Currency: "usd",
				Created: time.Now().Unix(), Status: "succeeded", Metadata: map[string]string{},
				PaymentMethodTypes: []string{"card"}, Account: "acct_1",
			})
		}()
		http.Error(w, "timed out", http.StatusServiceUnavailable)
	}))
	req := httptest.NewRequest(http.MethodPost, "/v1/payment_intents", strings.NewReader(`amount=100`))
	req.Header.Set("Idempotency-Key", "k-late")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusServiceUnavailable {
		t.Fatalf("first answer %d %s", rec.Code, rec.Body)
	}
	close(answered)
	err := <-late
	t.Logf("late Create: %v (matches idem.ErrNoTx: %v)", err, errors.Is(err, idem.ErrNoTx))
	if _, gerr := b.ledger.Get(context.Background(), "acct_1", "pi_late"); gerr == nil {
		t.Errorf("a payment the handler's goroutine recorded after the request was answered 503 (nothing stored) committed outside the request's transaction; want it refused")
	}
}
