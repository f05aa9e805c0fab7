package pitfalls

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem/client"
)

// Trap (e): the key stops at the order service. The order service runs
// its request once per key, but an attempt that fails after the gateway
// charged (the answer dropped) is retried, and a retry that calls the
// gateway without the operation's key (or with a new one, as stripe-go
// makes when given none) is a new payment: one order, two charges.

// TestPaymentKeyPassedOn: the gateway charges the first payment and
// drops its answer (its FailAfterCharge fault), the order service answers
// 502 and the client retries with the same Idempotency-Key. An order
// service that pays without passing a key on makes one order and two
// charges for it; one that pays with the key derived from the operation
// (orders.PaymentKey) makes one charge, which the gateway replays to the
// retry even when the look-up of the order's payment fails, and which the
// look-up finds when it works.
func TestPaymentKeyPassedOn(t *testing.T) {
	for _, tc := range []struct {
		name         string
		mode         payerMode
		charges      int   // succeeded PaymentIntents
		chargeCalls  int64 // POST /v1/payment_intents received
		distinctRefs int   // order_refs among them
	}{
		{"naive/no key passed on", payNoKey, 2, 2, 1},
		{"naive/a new key per attempt", payNewKey, 2, 2, 1},
		{"derived key, look-up failing", payDerivedNoSearch, 1, 2, 1},
		{"derived key and look-up", payDerived, 1, 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newService(t, serviceConfig{payer: tc.mode})
			s.gw.dropNext.Store(true)
			var retried atomic.Int64
			hc := &http.Client{Transport: &client.Transport{
				Base: s.srv.Client().Transport,
				OnRetry: func(_ int, resp *http.Response, _ error, _ time.Duration) {
					if resp != nil && resp.StatusCode == http.StatusBadGateway {
						retried.Add(1)
					}
				},
			}}
			a := send(hc, s.request(t, client.WithKey(context.Background(), "checkout-1"), s.srv.URL, "alice"))
			if a.status != http.StatusCreated || retried.Load() != 1 {
				t.Fatalf("checkout: %d %v %s after %d retried 502s; want a 201 after one", a.status, a.err, a.body, retried.Load())
			}
			ids, refs := s.orderIDs(t, "alice"), s.gw.succeeded(t)
			distinct := map[string]bool{}
			for _, r := range refs {
				distinct[r] = true
			}
			if len(ids) != 1 || len(refs) != tc.charges || len(distinct) != tc.distinctRefs || !distinct[ids[0]] || s.gw.charges.Load() != tc.chargeCalls {
				t.Errorf("orders %v, charges for %v, %d charge calls; want 1 order, %d charges for it, %d calls",
					ids, refs, s.gw.charges.Load(), tc.charges, tc.chargeCalls)
			}
		})
	}
}
