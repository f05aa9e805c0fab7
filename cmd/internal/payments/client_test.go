package payments

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stripe/stripe-go/v82"
)

// TestStripeGoThroughDroppedConnections drives the gateway with the
// official client: half of the first attempts are charged and then lose
// their connection; stripe-go retries them with the same key, and every
// key ends with exactly one PaymentIntent.
func TestStripeGoThroughDroppedConnections(t *testing.T) {
	forEachBackend(t, testStripeGoThroughDroppedConnections)
}

func testStripeGoThroughDroppedConnections(t *testing.T, be testBackend) {
	db := be.open(t, nil)
	srv, b := setup(t, Config{Store: db.store, Ledger: db.ledger, FailAfterCharge: 0.5})
	// A fresh connection per attempt: net/http would otherwise retry some
	// drops on its own, and the point is that stripe-go does.
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	sc := stripe.NewClient(testKey, stripe.WithBackends(stripe.NewBackendsWithConfig(&stripe.BackendConfig{
		URL:               stripe.String(srv.URL),
		HTTPClient:        hc,
		MaxNetworkRetries: stripe.Int64(5),
		LeveledLogger:     &stripe.LeveledLogger{Level: stripe.LevelNull},
	})))

	const keys = 50
	ids := make([]string, keys)
	var wg sync.WaitGroup
	for i := range keys {
		wg.Go(func() {
			params := &stripe.PaymentIntentCreateParams{
				Amount:        stripe.Int64(int64(100 + i)),
				Currency:      stripe.String("eur"),
				Confirm:       stripe.Bool(true),
				PaymentMethod: stripe.String("pm_card_visa"),
				Metadata:      map[string]string{"order_ref": fmt.Sprintf("ord_%d", i)},
			}
			params.AddExpand("latest_charge")
			params.SetIdempotencyKey(fmt.Sprintf("order-%d", i))
			pi, err := sc.V1PaymentIntents.Create(context.Background(), params)
			if err != nil {
				t.Errorf("key %d: %v", i, err)
				return
			}
			if pi.Status != stripe.PaymentIntentStatusSucceeded || pi.Amount != int64(100+i) {
				t.Errorf("key %d: %s %d, want succeeded %d", i, pi.Status, pi.Amount, 100+i)
			}
			ids[i] = pi.ID
		})
	}
	wg.Wait()

	all := ledgerAll(t, db.ledger, testKey)
	if got, want := len(all), keys; got != want {
		t.Errorf("PaymentIntents = %d, want %d", got, want)
	}
	byRef := map[string]string{}
	for _, pi := range all {
		byRef[pi.Metadata["order_ref"]] = pi.ID
	}
	for i, id := range ids {
		if want := byRef[fmt.Sprintf("ord_%d", i)]; id != want {
			t.Errorf("key %d: client got %s, ledger has %s", i, id, want)
		}
	}
	if b.gw.dropped.Load() == 0 {
		t.Error("no connection was dropped; the test proves nothing")
	}
	t.Logf("%d of %d first attempts dropped", b.gw.dropped.Load(), keys)

	// The list endpoint pages through stripe-go's iterator too.
	n := 0
	lp := &stripe.PaymentIntentListParams{}
	lp.Limit = stripe.Int64(7)
	for _, err := range sc.V1PaymentIntents.List(context.Background(), lp) {
		if err != nil {
			t.Fatal(err)
		}
		n++
	}
	if n != keys {
		t.Errorf("stripe-go listed %d, want %d", n, keys)
	}
}

func inProcessClient(t *testing.T, cfg Config, retries int) (*Client, *testBundle) {
	t.Helper()
	b := &testBundle{ledger: NewMemLedger()}
	if cfg.Ledger == nil {
		cfg.Ledger = b.ledger
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	b.gw = NewServer(cfg)
	c := NewClient(ClientConfig{
		BaseURL:           InProcessURL,
		APIKey:            testKey,
		HTTPClient:        InProcess(b.gw),
		MaxNetworkRetries: retries,
	})
	return c, b
}

func TestClientInProcess(t *testing.T) {
	ctx := context.Background()
	c, b := inProcessClient(t, Config{DeclineOver: 10_000}, 0)
	req := ChargeRequest{Amount: 2598, Currency: "EUR", IdempotencyKey: "user-1/order-1", Metadata: map[string]string{"order_ref": "ord_1"}}
	ch, err := c.Charge(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if ch.Status != StatusSucceeded || ch.Amount != 2598 || ch.Currency != "eur" || ch.Metadata["order_ref"] != "ord_1" || ch.Replayed {
		t.Errorf("charge = %+v", ch)
	}
	again, err := c.Charge(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if again.ID != ch.ID || !again.Replayed {
		t.Errorf("repeat = %s replayed %v, want %s replayed", again.ID, again.Replayed, ch.ID)
	}
	if got, want := b.ledger.Len(), 1; got != want {
		t.Errorf("ledger holds %d, want %d", got, want)
	}

	got, err := c.Get(ctx, ch.ID)
	if err != nil || got.ID != ch.ID {
		t.Errorf("Get = %+v, %v", got, err)
	}
	if _, err := c.Get(ctx, "pi_nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get of a missing one = %v, want ErrNotFound", err)
	}

	_, err = c.Charge(ctx, ChargeRequest{Amount: 10_001, Currency: "eur", IdempotencyKey: "user-1/order-2"})
	var de *DeclinedError
	if !errors.Is(err, ErrDeclined) || !errors.As(err, &de) {
		t.Fatalf("over the limit: err = %v, want ErrDeclined", err)
	}
	if de.DeclineCode != "insufficient_funds" || de.Charge == nil || de.Charge.Status != StatusRequiresPaymentMethod {
		t.Errorf("declined = %+v charge %+v", de, de.Charge)
	}
	_, err = c.Charge(ctx, ChargeRequest{Amount: 100, Currency: "eur", PaymentMethod: "pm_card_chargeDeclined", IdempotencyKey: "user-1/order-3"})
	if !errors.Is(err, ErrDeclined) {
		t.Errorf("declined card: err = %v, want ErrDeclined", err)
	}
	_, err = c.Charge(ctx, ChargeRequest{Amount: 100, Currency: "eur", PaymentMethod: "pm_card_chargeDeclined", IdempotencyKey: "user-1/order-3"})
	if !errors.As(err, &de) || de.Charge == nil || !de.Charge.Replayed {
		t.Errorf("repeated decline: err = %v, want a replayed DeclinedError", err)
	}

	// Same key, other parameters: an error, not a decline, and no charge.
	_, err = c.Charge(ctx, ChargeRequest{Amount: 1, Currency: "eur", IdempotencyKey: "user-1/order-1"})
	var se *stripe.Error
	if err == nil || errors.Is(err, ErrDeclined) || !errors.As(err, &se) || se.Type != stripe.ErrorTypeIdempotency {
		t.Errorf("key reuse: err = %v, want a wrapped idempotency_error", err)
	}

	var listed []string
	for ch, err := range c.All(ctx) {
		if err != nil {
			t.Fatal(err)
		}
		listed = append(listed, ch.ID)
	}
	if got, want := len(listed), 3; got != want {
		t.Errorf("All listed %d, want %d", got, want)
	}
}

func TestClientInProcessRetriesDroppedCharge(t *testing.T) {
	c, b := inProcessClient(t, Config{FailAfterCharge: 1}, 1)
	ch, err := c.Charge(context.Background(), ChargeRequest{Amount: 100, Currency: "eur", IdempotencyKey: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if !ch.Replayed {
		t.Error("the retry was not a replay")
	}
	if got, want := b.ledger.Len(), 1; got != want {
		t.Errorf("ledger holds %d, want %d", got, want)
	}
	if got, want := b.gw.dropped.Load(), int64(1); got != want {
		t.Errorf("dropped %d, want %d", got, want)
	}
}

func TestClientInProcessNoRetries(t *testing.T) {
	c, b := inProcessClient(t, Config{FailAfterCharge: 1}, -1)
	_, err := c.Charge(context.Background(), ChargeRequest{Amount: 100, Currency: "eur", IdempotencyKey: "k"})
	if !errors.Is(err, ErrConnectionDropped) {
		t.Errorf("err = %v, want ErrConnectionDropped", err)
	}
	if got, want := b.ledger.Len(), 1; got != want {
		t.Errorf("ledger holds %d, want %d: the charge was made", got, want)
	}
}

func TestClientInProcessContext(t *testing.T) {
	c, b := inProcessClient(t, Config{Latency: time.Second}, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := c.Charge(ctx, ChargeRequest{Amount: 100, Currency: "eur", IdempotencyKey: "k"})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v, want context.DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 500*time.Millisecond { // the gateway takes 1s
		t.Errorf("Charge returned after %v, want at the deadline", d)
	}
	// The gateway goes on and charges; the same key then replays it.
	ch, err := c.Charge(context.Background(), ChargeRequest{Amount: 100, Currency: "eur", IdempotencyKey: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := b.ledger.Len(), 1; got != want {
		t.Errorf("ledger holds %d, want %d", got, want)
	}
	if !ch.Replayed {
		t.Error("the second Charge was not a replay")
	}
}

func TestClientAuthError(t *testing.T) {
	gw := NewServer(Config{APIKey: "sk_test_right", Logger: slog.New(slog.DiscardHandler)})
	c := NewClient(ClientConfig{BaseURL: InProcessURL, APIKey: "sk_test_wrong", HTTPClient: InProcess(gw)})
	_, err := c.Charge(context.Background(), ChargeRequest{Amount: 100, Currency: "eur"})
	var se *stripe.Error
	if errors.Is(err, ErrDeclined) || !errors.As(err, &se) || se.HTTPStatusCode != http.StatusUnauthorized {
		t.Errorf("err = %v, want a wrapped 401", err)
	}
}
