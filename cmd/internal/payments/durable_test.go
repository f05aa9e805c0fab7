package payments

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/storetest"
)

// TestGatewayRestart: a gateway on a database remembers its idempotency
// keys and PaymentIntents across a restart, so the order service's retry
// after a crash replays the payment instead of making a second one.
func TestGatewayRestart(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		if !be.durable {
			t.Skip("the memory backend forgets everything when the gateway stops")
		}
		db := be.open(t, nil)
		srv, _ := setup(t, Config{Store: db.store, Ledger: db.ledger})
		paid := create(t, srv, "user-1/order-1", chargeForm(1299, "pm_card_visa"))
		wantStatus(t, paid, http.StatusOK)
		declined := create(t, srv, "user-1/order-2", chargeForm(500, "pm_card_chargeDeclined"))
		wantStatus(t, declined, http.StatusPaymentRequired)
		srv.Close()

		db = db.restart(t)
		srv, b := setup(t, Config{Store: db.store, Ledger: db.ledger})
		for _, tc := range []struct {
			key    string
			form   string
			first  result
			status int
		}{
			{"user-1/order-1", chargeForm(1299, "pm_card_visa").Encode(), paid, http.StatusOK},
			{"user-1/order-2", chargeForm(500, "pm_card_chargeDeclined").Encode(), declined, http.StatusPaymentRequired},
		} {
			again := do(t, srv.Client(), http.MethodPost, srv.URL+"/v1/payment_intents", testKey, tc.key, tc.form)
			wantStatus(t, again, tc.status)
			if got := again.header.Get("Idempotent-Replayed"); got != "true" {
				t.Errorf("%s: Idempotent-Replayed = %q after the restart, want true", tc.key, got)
			}
			if string(again.body) != string(tc.first.body) {
				t.Errorf("%s: replayed body\n%s\nwant\n%s", tc.key, again.body, tc.first.body)
			}
		}
		if r := create(t, srv, "user-1/order-1", chargeForm(1300, "pm_card_visa")); r.status != http.StatusBadRequest || decodeErr(t, r.body).Type != "idempotency_error" {
			t.Errorf("same key, other amount, after the restart: %d %s, want 400 idempotency_error", r.status, r.body)
		}
		id := decodePI(t, paid.body).ID
		g := do(t, srv.Client(), http.MethodGet, srv.URL+"/v1/payment_intents/"+id, testKey, "", "")
		wantStatus(t, g, http.StatusOK)
		if got := decodePI(t, g.body); got.ID != id || got.Status != StatusSucceeded || got.Metadata["order_ref"] != "ord_1" {
			t.Errorf("GET after the restart = %+v", got)
		}
		if got, want := db.count(t), 2; got != want {
			t.Errorf("ledger holds %d, want %d", got, want)
		}
		if n, err := CountSucceeded(context.Background(), db.ledger, AccountFor(testKey)); err != nil || n != 1 {
			t.Errorf("CountSucceeded = %d, %v; want 1", n, err)
		}
		if got := b.metrics.Executions.Load(); got != 0 {
			t.Errorf("the restarted gateway ran the handler %d times, want 0", got)
		}
	})
}

// TestGatewayFencedAttempt: an attempt whose lease ran out and was taken
// over cannot commit: its PaymentIntent never appears, and the key ends
// with the PaymentIntent of the attempt that took it over.
func TestGatewayFencedAttempt(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		clock := storetest.NewClock(time.Now())
		db := be.open(t, clock.Now)
		// The first charge is held until the retry has taken its key over
		// and finished (a fixed latency let the first one finish first
		// on a loaded machine, and the retry then replayed it).
		charging, release := holdFirstCharge(t)
		srv, b := setup(t, Config{Store: db.store, Ledger: db.ledger, Hold: release.hold, LockWait: -1})
		type answer struct {
			r   result
			err error
		}
		slow := make(chan answer, 1)
		go func() {
			r, err := post(srv, testKey, "k", chargeForm(500, "pm_card_visa"))
			slow <- answer{r, err}
		}()
		select {
		case <-charging:
		case a := <-slow:
			t.Fatalf("the first attempt ended (%d %s, %v) before it charged", a.r.status, a.r.body, a.err)
		case <-time.After(30 * time.Second):
			t.Fatal("the first attempt did not start charging within 30s")
		}
		// The first attempt is charging; its lease runs out, as when its
		// instance hangs, and a retry takes the key over.
		clock.Advance(2 * time.Minute)
		taker := create(t, srv, "k", chargeForm(500, "pm_card_visa"))
		wantStatus(t, taker, http.StatusOK)
		release.release()
		a := <-slow
		if a.err != nil {
			t.Fatal(a.err)
		}
		wantStatus(t, a.r, http.StatusTooManyRequests)
		if e := decodeErr(t, a.r.body); e.Code != "lock_timeout" {
			t.Errorf("fenced attempt: error code %q, want lock_timeout", e.Code)
		}
		id := decodePI(t, taker.body).ID
		all := ledgerAll(t, db.ledger, testKey)
		if len(all) != 1 || all[0].ID != id {
			t.Errorf("ledger = %v, want just %s", idsOf(all), id)
		}
		if got, want := db.count(t), 1; got != want {
			t.Errorf("ledger holds %d, want %d", got, want)
		}
		if got, want := b.metrics.Fenced.Load(), int64(1); got != want {
			t.Errorf("fenced %d, want %d", got, want)
		}
		again := create(t, srv, "k", chargeForm(500, "pm_card_visa"))
		wantStatus(t, again, http.StatusOK)
		if string(again.body) != string(taker.body) || again.header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("repeat = %s (replayed %q), want the replay of %s", again.body, again.header.Get("Idempotent-Replayed"), id)
		}
	})
}

// failingLedger fails the next failures Creates after they wrote.
type failingLedger struct {
	Ledger
	failures atomic.Int32
}

func (l *failingLedger) Create(ctx context.Context, pi *PaymentIntent) error {
	if err := l.Ledger.Create(ctx, pi); err != nil {
		return err
	}
	if l.failures.Add(-1) >= 0 {
		return errors.New("injected failure after the write")
	}
	return nil
}

// TestGatewayFailedAttempt: an attempt that fails after its ledger write
// leaves no PaymentIntent, and the same request sent again runs again.
func TestGatewayFailedAttempt(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		db := be.open(t, nil)
		fl := &failingLedger{Ledger: db.ledger}
		fl.failures.Store(1)
		srv, b := setup(t, Config{Store: db.store, Ledger: fl})
		failed := create(t, srv, "k", chargeForm(500, "pm_card_visa"))
		wantStatus(t, failed, http.StatusInternalServerError)
		if got, want := decodeErr(t, failed.body).Type, "api_error"; got != want {
			t.Errorf("error type = %q, want %q", got, want)
		}
		if got := db.count(t); got != 0 {
			t.Fatalf("ledger holds %d after a failed attempt, want 0", got)
		}
		again := create(t, srv, "k", chargeForm(500, "pm_card_visa"))
		wantStatus(t, again, http.StatusOK)
		if again.header.Get("Idempotent-Replayed") != "" {
			t.Error("the retry of a failed attempt was replayed, want it run again")
		}
		if got, want := db.count(t), 1; got != want {
			t.Errorf("ledger holds %d, want %d", got, want)
		}
		if got, want := b.metrics.Executions.Load(), int64(2); got != want {
			t.Errorf("handler ran %d times, want %d", got, want)
		}
	})
}

// TestGatewayInProcessClientGoesAway: the order service's in-process
// client gives up while the gateway charges; on a database too the charge
// commits, and the same key replays it.
func TestGatewayInProcessClientGoesAway(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		db := be.open(t, nil)
		// The client gives up once the gateway is charging, that is after
		// it claimed the key (a fixed 20 ms deadline could end the request
		// before the claim on a loaded machine, and then nothing was
		// charged and the second Charge was no replay).
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		c, _ := inProcessClient(t, Config{Store: db.store, Ledger: db.ledger, Hold: cancel}, 2)
		if _, err := c.Charge(ctx, ChargeRequest{Amount: 100, Currency: "eur", IdempotencyKey: "k"}); !errors.Is(err, context.Canceled) {
			t.Errorf("err = %v, want context.Canceled", err)
		}
		ch, err := c.Charge(context.Background(), ChargeRequest{Amount: 100, Currency: "eur", IdempotencyKey: "k"})
		if err != nil {
			t.Fatal(err)
		}
		if !ch.Replayed {
			t.Error("the second Charge was not a replay")
		}
		if got, want := db.count(t), 1; got != want {
			t.Errorf("ledger holds %d, want %d", got, want)
		}
	})
}

// TestInProcessCallerTransaction: an order service pays from inside its
// own idempotent request. The in-process gateway must not see that
// request's transaction: a charge without a key is written at once, and
// stays when the order service's attempt then fails.
func TestInProcessCallerTransaction(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		db := be.open(t, nil)
		gw := NewServer(Config{Store: db.store, Ledger: db.ledger, Logger: slog.New(slog.DiscardHandler)})
		hc := InProcess(gw)
		var paid result
		orders := idem.Middleware(memstore.New(memstore.Options{}), idem.Options{User: idem.SharedKeySpace})(
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if _, err := memstore.FromContext(r.Context()); err != nil { // the order service's tx is begun
					t.Errorf("order service's tx: %v", err)
				}
				req, _ := http.NewRequestWithContext(r.Context(), http.MethodPost, InProcessURL+"/v1/payment_intents",
					strings.NewReader(chargeForm(500, "pm_card_visa").Encode()))
				req.Header.Set("Authorization", "Bearer "+testKey)
				req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
				resp, err := hc.Do(req)
				if err != nil {
					t.Errorf("paying: %v", err)
					return
				}
				defer resp.Body.Close()
				body, _ := io.ReadAll(resp.Body)
				paid = result{resp.StatusCode, resp.Header, body}
				w.WriteHeader(http.StatusInternalServerError) // the order fails after the payment
			}))
		req := httptest.NewRequest(http.MethodPost, "/v1/orders", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "order-key")
		orders.ServeHTTP(httptest.NewRecorder(), req)
		wantStatus(t, paid, http.StatusOK)
		if got, want := db.count(t), 1; got != want {
			t.Errorf("gateway ledger holds %d, want %d: the charge it answered 200 must stay", got, want)
		}
	})
}

// chargeHold holds the first charge a gateway makes (Config.Hold) until
// release is called, and lets every later one through.
type chargeHold struct {
	calls    atomic.Int32
	charging chan struct{}
	released chan struct{}
	once     sync.Once
}

// holdFirstCharge returns a channel closed when the first charge is held,
// and the hold to put in Config.Hold. The test ends with the hold
// released, whatever happened.
func holdFirstCharge(t *testing.T) (<-chan struct{}, *chargeHold) {
	h := &chargeHold{charging: make(chan struct{}), released: make(chan struct{})}
	t.Cleanup(h.release)
	return h.charging, h
}

func (h *chargeHold) hold() {
	if h.calls.Add(1) != 1 {
		return
	}
	close(h.charging)
	<-h.released
}

func (h *chargeHold) release() { h.once.Do(func() { close(h.released) }) }
