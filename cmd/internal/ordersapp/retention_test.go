package ordersapp

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
)

// TestRetryAfterGatewayRetentionPaysOnce checks that an unanswered
// operation run again after the gateway's key retention pays once.
//
// It guards a bug found in a review of issue 8, as it was found: a record without a
// response never expires (issue 8, R2), so an attempt that paid and then
// failed (5xx) can be run again at any later time: by the client's retry,
// by the completer, or by `orders keys redrive` after the completer gave
// up. Every such run pays with the same derived payment key, which is
// only safe while the gateway still remembers it; the gateway forgets its
// keys after its retention (Stripe's 24 hours; the in-process gateway's
// max(--key-ttl, 24h)). A run after that is a new payment at the gateway,
// and the first payment is left without its order: two charges for one
// operation. Scaled down here: key TTL 1s, lease 0.9s, the gateway's
// retention 2s (not shorter than the TTL, as serve requires); the first
// attempt pays and its order write fails once (a transient SQLSTATE
// 40001); the client's retry after the gateway's retention takes the key
// over and pays again.
func TestRetryAfterGatewayRetentionPaysOnce(t *testing.T) {
	ctx := context.Background()
	db := pgtest.Database(t)
	c := Config{DataDir: t.TempDir(), DatabaseURL: db, JWTSecret: testSecret, KeyTTL: time.Second, KeyLease: 900 * time.Millisecond,
		PaymentsKey: "sk_test_local", RequireKey: true}
	be, err := openBackend(ctx, &c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.close() })
	gstore, ledger, err := be.gateway(ctx)
	if err != nil {
		t.Fatal(err)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	gw := payments.NewServer(payments.Config{APIKey: "sk_test_local", Store: gstore, Ledger: ledger,
		KeyRetention: 2 * time.Second, Logger: quiet})
	pc := payments.NewClient(payments.ClientConfig{BaseURL: payments.InProcessURL, APIKey: "sk_test_local", HTTPClient: payments.InProcess(gw)})
	// The handler knows the gateway's retention, as serve's does: the retry
	// after it must find the payment, and a failed lookup must not pay.
	h := orders.NewHandler(orders.Config{Repo: be.repo, Payer: payer{c: pc, gw: gw}, Idem: be.store, Secret: []byte(testSecret),
		IdemOptions: idem.Options{TTL: c.KeyTTL, Lease: c.KeyLease}, Logger: quiet, PaymentKeyRetention: 2 * time.Second})
	hs := httptest.NewServer(h)
	defer hs.Close()

	pgExec(t, db, blipTrigger...)
	send := func() int {
		req, _ := http.NewRequest("POST", hs.URL+"/v1/orders", strings.NewReader(orderBody(3)))
		req.Header.Set("Authorization", "Bearer "+token(t, "late-alice"))
		req.Header.Set("Idempotency-Key", "order-late")
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	if s := send(); s != http.StatusServiceUnavailable {
		t.Fatalf("first attempt: %d, want 503 (paid, order write refused once)", s)
	}
	pgExec(t, db, `DELETE FROM review_blip`)
	time.Sleep(2500 * time.Millisecond) // not waiting for an outcome: the real clock (gateway, handler, PostgreSQL) passes the gateway's retention
	if s := send(); s != http.StatusCreated {
		t.Fatalf("retry: %d, want 201", s)
	}
	succeeded := 0
	for ch, err := range pc.All(ctx) {
		if err != nil {
			t.Fatal(err)
		}
		if ch.Status == "succeeded" {
			succeeded++
		}
	}
	if succeeded != 1 {
		t.Errorf("one operation (one key, one CreatedAt, one payment key), %d succeeded PaymentIntents; want 1: "+
			"the unanswered record outlived the gateway's memory of its payment key", succeeded)
	}
}

// TestUnansweredOrderPaysOnceAfterGatewayForgetsKey checks that an order
// key without an answer, taken over after the gateway forgot its payment
// key, pays once.
//
// TestUnansweredOrderPaysOnceAfterGatewayForgetsKey (second review of issue 8,
// finding 1): an order key without an answer never expires, so the
// client's retry, the completer and `orders keys redrive` take it over,
// as the same operation, however late, and every such run pays with the
// same derived payment key. The gateway forgets that key after its
// retention (Stripe: 24 h; the in-process gateway: max(--key-ttl, 24h)).
// A run after that used to pay a second time, leaving the first payment
// without its order; it now finds the first payment by the order's
// reference (the Search API) and writes the order with it.
//
// Real orders serve on PostgreSQL with the in-process gateway: the first
// attempt pays, then its INSERT fails with a transient error (503, key
// kept, nothing stored). A day passes (the gateway's key is aged by 25 h
// in SQL, as its cleaner or its Claim would see it after a day); the
// client retries the next day.
func TestUnansweredOrderPaysOnceAfterGatewayForgetsKey(t *testing.T) {
	ordersBin, _ := binaries(t)
	db, dir := pgtest.Database(t), t.TempDir()
	if code, out, errs := run(t, nil, "migrate", "--database-url", db, "--data-dir", dir); code != 0 {
		t.Fatalf("migrate: %d %s %s", code, out, errs)
	}
	pgExec(t, db, blipTrigger...)
	addr := freeAddr(t)
	start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", dir, "--database-url", db,
		"--jwt-secret", testSecret, "--key-lease", "2s")
	base := "http://" + addr

	body := `{"items":[{"sku":"SKU-1","quantity":1,"unit_price":1000}],"currency":"EUR"}`
	if s, b := postBody(t, base, "unlucky", "k-1", body); s != http.StatusServiceUnavailable {
		t.Fatalf("first attempt: %d %s; want 503 (paid, order not written)", s, b)
	}
	// A day later: the gateway's retention of the payment key has passed.
	pgExec(t, db, `UPDATE payments.idempotency_keys SET created_at = created_at - interval '25 hours',
		completed_at = completed_at - interval '25 hours', expires_at = expires_at - interval '25 hours'`,
		`DELETE FROM review_blip`)
	var s int
	var b string
	for i := 0; i < 20; i++ {
		if s, b = postBody(t, base, "unlucky", "k-1", body); s != http.StatusConflict {
			break
		}
		time.Sleep(200 * time.Millisecond) // a client's pause between retries (20 at most) while the key is in flight
	}
	if s != http.StatusCreated {
		t.Fatalf("retry: %d %s", s, b)
	}
	var o orders.Order
	if err := json.Unmarshal([]byte(b), &o); err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, db, `SELECT count(*) FROM payments.payment_intents WHERE status = 'succeeded' AND metadata->>'order_ref' = '`+o.ID+`'`); n != 1 {
		t.Errorf("order %s: %d succeeded payments at the in-process gateway, want 1 (the gateway forgot the payment key while the order key was unanswered)", o.ID, n)
	}
	if n := countRows(t, db, `SELECT count(*) FROM payments.payment_intents WHERE id = '`+o.PaymentID+`'`); n != 1 {
		t.Errorf("order %s names payment %s, which the gateway does not have", o.ID, o.PaymentID)
	}
	code, out, errs := run(t, nil, "audit", "--database-url", db, "--data-dir", dir)
	if code != 0 {
		t.Errorf("audit: exit %d\n%s%s", code, out, errs)
	}
}

// TestPaymentKeyRetention: serve tells the order handler how long its
// gateway surely keeps payment keys: 24h, the in-process gateway's floor
// (a key used before --key-ttl was raised kept the shorter retention of
// its day), or an external gateway's 24h.
func TestPaymentKeyRetention(t *testing.T) {
	for _, tc := range []struct {
		c    Config
		want time.Duration
	}{
		{Config{KeyTTL: time.Hour}, payments.DefaultKeyRetention},
		{Config{KeyTTL: 48 * time.Hour}, payments.DefaultKeyRetention},
		{Config{KeyTTL: time.Hour, PaymentsURL: "http://127.0.0.1:1"}, externalKeyRetention},
	} {
		if got := paymentKeyRetention(&tc.c); got != tc.want {
			t.Errorf("--key-ttl %v, --payments-url %q: %v, want %v", tc.c.KeyTTL, tc.c.PaymentsURL, got, tc.want)
		}
	}
}

// searchDownPayer is the in-process payer with its search failing (a
// database blip during the lookup, say), its payments working.
type searchDownPayer struct{ payer }

func (p searchDownPayer) FindPayment(context.Context, string) (orders.PaymentResult, bool, error) {
	return orders.PaymentResult{}, false, errors.New("review4: search unavailable")
}

// TestRaisedKeyTTLFallbackPaysOnce checks that an operation retried after
// --key-ttl was raised, with the payment search down, does not pay a
// second time.
//
// It guards a bug found in the fourth review of issue 8 (it failed on main as of dac673d), as it was found: when the lookup of an earlier
// attempt's payment fails, the handler pays with the operation's key if
// the operation is younger than PaymentKeyRetention less 1h, and serve
// computes PaymentKeyRetention from the *present* --key-ttl
// (max(--key-ttl, 24h) for the in-process gateway). But the gateway's key
// keeps the retention it was created with: the idem store fixes
// expires_at when the key is first used. So after serve is restarted with
// a longer --key-ttl (24h → 48h; or, in a rolling change, on the
// instances already running the new value), an unanswered operation paid
// under the old retention and retried 25 hours later, when the search
// fails, is judged "young" (25h < 47h) and pays with a key the gateway
// has already forgotten: a second charge, the first payment left without
// its order.
//
// Real PostgreSQL, the in-process gateway as serve builds it. The first
// attempt pays (gateway retention 24h, serve's with --key-ttl 24h) and
// its order INSERT fails transiently (503). serve restarts with --key-ttl
// 48h. 25 hours pass: the gateway key is aged in SQL (as its Claim sees
// it by the database's clock) and the handler's clock runs 25h ahead. The
// retry's lookup fails.
func TestRaisedKeyTTLFallbackPaysOnce(t *testing.T) {
	ctx := context.Background()
	db := pgtest.Database(t)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	c1 := Config{DataDir: t.TempDir(), DatabaseURL: db, JWTSecret: testSecret, KeyTTL: 24 * time.Hour, KeyLease: 2 * time.Second,
		PaymentsKey: "sk_test_local", RequireKey: true}
	be, err := openBackend(ctx, &c1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.close() })
	gstore, ledger, err := be.gateway(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgExec(t, db, blipTrigger...)

	// handler builds the order API as serve does with config c, its clock
	// shifted by skew, the gateway's search failing if searchDown.
	handler := func(c *Config, skew time.Duration, searchDown bool) *httptest.Server {
		gw := payments.NewServer(payments.Config{APIKey: "sk_test_local", Store: gstore, Ledger: ledger,
			KeyRetention: gatewayKeyRetention(c), Logger: quiet})
		pc := payments.NewClient(payments.ClientConfig{BaseURL: payments.InProcessURL, APIKey: "sk_test_local", HTTPClient: payments.InProcess(gw)})
		var p orders.Payer = payer{c: pc, gw: gw}
		if searchDown {
			p = searchDownPayer{payer{c: pc, gw: gw}}
		}
		h := orders.NewHandler(orders.Config{Repo: be.repo, Payer: p, Idem: be.store, Secret: []byte(testSecret),
			IdemOptions: idem.Options{TTL: c.KeyTTL, Lease: c.KeyLease}, Logger: quiet,
			Now:                 func() time.Time { return time.Now().Add(skew) },
			PaymentKeyRetention: paymentKeyRetention(c)})
		hs := httptest.NewServer(h)
		t.Cleanup(hs.Close)
		return hs
	}
	tok, err := orders.IssueToken([]byte(testSecret), "raised-ttl", 72*time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	send := func(base string) (int, string) {
		req, _ := http.NewRequest("POST", base+"/v1/orders", strings.NewReader(orderBody(5)))
		req.Header.Set("Authorization", "Bearer "+tok)
		req.Header.Set("Idempotency-Key", "order-raised")
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}

	before := handler(&c1, 0, false)
	if s, b := send(before.URL); s != http.StatusServiceUnavailable {
		t.Fatalf("first attempt: %d %s; want 503 (paid, order write refused once)", s, b)
	}
	// 25 hours later, serve runs with --key-ttl 48h.
	pgExec(t, db, `UPDATE payments.idempotency_keys SET created_at = created_at - interval '25 hours',
		completed_at = completed_at - interval '25 hours', expires_at = expires_at - interval '25 hours'`,
		`DELETE FROM review_blip`)
	c2 := c1
	c2.KeyTTL = 48 * time.Hour
	after := handler(&c2, 25*time.Hour, true)
	s, b := send(after.URL)
	succeeded := countRows(t, db, `SELECT count(*) FROM payments.payment_intents WHERE status = 'succeeded'`)
	if succeeded != 1 {
		t.Errorf("retry 25h later with --key-ttl raised to 48h and the search down: %d %s; %d succeeded payments for one operation, want 1: "+
			"serve judged the operation young by today's retention (%v), but the gateway key kept the 24h it was made with",
			s, tail(b, 200), succeeded, paymentKeyRetention(&c2))
	}
}
