package ordersapp

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/sqlitestore"
)

// purgeEnv is a service's database with an order handler in front of it,
// whose gateway (the in-process one, on the same database) can be taken
// down, and the `orders keys` command line on the same database.
type purgeEnv struct {
	t     *testing.T
	dir   string
	dbURL string
	be    *backend
	pay   payer
	flaky *opsFlakyPayer
	url   string // the order handler's
}

func newPurgeEnv(t *testing.T, dbURL string) *purgeEnv {
	t.Helper()
	ctx := context.Background()
	e := &purgeEnv{t: t, dir: t.TempDir(), dbURL: dbURL}
	c := Config{DataDir: e.dir, DatabaseURL: dbURL, JWTSecret: testSecret, KeyTTL: 24 * time.Hour, KeyLease: 5 * time.Second,
		PaymentsKey: "sk_test_local", RequireKey: true}
	be, err := openBackend(ctx, &c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.close() })
	e.be = be
	if e.pay, _, err = newPayer(ctx, &c, be); err != nil {
		t.Fatal(err)
	}
	e.flaky = &opsFlakyPayer{Payer: e.pay}
	cfg := orders.Config{Repo: be.repo, Payer: e.flaky, Idem: be.store, Secret: []byte(testSecret),
		IdemOptions: idem.Options{TTL: c.KeyTTL, Lease: c.KeyLease, MaxStoredBody: orders.MaxStoredResponse, Stored: orders.StoredStatus},
		Logger:      slog.New(slog.DiscardHandler), PaymentKeyRetention: payments.DefaultKeyRetention}
	hs := httptest.NewServer(orders.NewHandler(cfg))
	t.Cleanup(hs.Close)
	e.url = hs.URL
	return e
}

// keys runs `orders keys args…` on the environment's database.
func (e *purgeEnv) keys(args ...string) (int, string, string) {
	e.t.Helper()
	return run(e.t, nil, append(append([]string{"keys"}, args...), "--data-dir", e.dir, "--database-url", e.dbURL)...)
}

// purge runs `orders keys purge --user user --key key args…`.
func (e *purgeEnv) purge(user, key string, args ...string) (int, string, string) {
	e.t.Helper()
	return e.keys(append([]string{"purge", "--user", user, "--key", key}, args...)...)
}

// claim claims (user, key) for an order request, with lease.
func (e *purgeEnv) claim(user, key string, lease time.Duration) *idemdriver.Lease {
	e.t.Helper()
	c, err := e.be.store.Claim(context.Background(), idemdriver.ClaimParams{User: user, Key: key, Fingerprint: "fp-" + key,
		Method: http.MethodPost, Path: "/v1/orders", Lease: lease})
	if err != nil || c.Lease == nil {
		e.t.Fatalf("Claim(%s) = %+v, %v", key, c, err)
	}
	return c.Lease
}

// sql runs one statement on the environment's database: stmt is written
// with $1, $2… and run as it is on PostgreSQL, with ? on SQLite.
func (e *purgeEnv) sql(stmt string, args ...any) {
	e.t.Helper()
	ctx := context.Background()
	if e.be.pg != nil {
		if _, err := e.be.pg.Exec(ctx, stmt, args...); err != nil {
			e.t.Fatalf("%s: %v", stmt, err)
		}
		return
	}
	for i := len(args); i >= 1; i-- {
		stmt = strings.ReplaceAll(stmt, "$"+string(rune('0'+i)), "?")
	}
	if _, err := e.be.store.(*sqlitestore.Store).DB().ExecContext(ctx, stmt, args...); err != nil {
		e.t.Fatalf("%s: %v", stmt, err)
	}
}

// endLease makes (user, key)'s lease end ago before now (by this
// machine's clock; the database's on PostgreSQL).
func (e *purgeEnv) endLease(user, key string, ago time.Duration) {
	e.t.Helper()
	if e.be.pg != nil {
		e.sql(`UPDATE idempotency_keys SET lease_until = now() - $1::interval WHERE user_id = $2 AND key = $3`, ago, user, key)
		return
	}
	e.sql(`UPDATE idempotency_keys SET lease_until = $1 WHERE user_id = $2 AND key = $3`, time.Now().Add(-ago).UnixNano(), user, key)
}

// record returns (user, key)'s record, or nil when there is none.
func (e *purgeEnv) record(user, key string) *idemdriver.Record {
	e.t.Helper()
	rec, err := e.be.store.Get(context.Background(), user, key)
	if err != nil {
		return nil
	}
	return rec
}

// wantRefused checks a refusal: exit 1, one line on stderr holding every
// one of want, nothing on stdout.
func wantRefused(t *testing.T, what string, code int, out, errs string, want ...string) {
	t.Helper()
	t.Logf("%s: %s", what, errs)
	if code != 1 || out != "" || strings.Count(errs, "\n") != 1 {
		t.Errorf("%s: exit %d\nstdout %q\nstderr %q\nwant exit 1, one line on stderr, nothing on stdout", what, code, out, errs)
	}
	for _, w := range want {
		if !strings.Contains(errs, w) {
			t.Errorf("%s: stderr %q, want it to say %q", what, errs, w)
		}
	}
}

// TestKeysPurge: `orders keys purge` refuses a key in flight, a completed
// one, one whose lease ended too recently for its attempt to have
// stopped paying, one whose operation has a payment (or an order) but no
// answer, and any key when the gateway cannot be asked, changing nothing;
// it purges an abandoned key and a given-up one, after which a retry of
// the key runs again, as a new operation, and pays once. On SQLite, and
// on PostgreSQL when TEST_DATABASE_URL is set.
func TestKeysPurge(t *testing.T) {
	skipInShort(t, "drives purges through a running service and gateway")
	t.Parallel()
	t.Run("sqlite", func(t *testing.T) { keysPurge(t, "") })
	t.Run("postgres", func(t *testing.T) { keysPurge(t, pgtest.Database(t)) })
}

func keysPurge(t *testing.T, dbURL string) {
	ctx := context.Background()
	e := newPurgeEnv(t, dbURL)
	const user = "purge-alice"

	t.Run("in flight", func(t *testing.T) {
		e.claim(user, "k-flight", time.Hour)
		before := e.record(user, "k-flight")
		code, out, errs := e.purge(user, "k-flight")
		wantRefused(t, "purge of an in-flight key", code, out, errs, "refused", "in-flight", "nothing purged")
		if after := e.record(user, "k-flight"); after == nil || after.Owner != before.Owner {
			t.Errorf("the in-flight key changed: %+v", after)
		}
	})

	t.Run("completed", func(t *testing.T) {
		if s, b := postBody(t, e.url, user, "k-done", orderBody(1)); s != http.StatusCreated {
			t.Fatalf("order: %d %s", s, b)
		}
		code, out, errs := e.purge(user, "k-done")
		wantRefused(t, "purge of a completed key", code, out, errs, "refused", "completed", "orders gc")
		if rec := e.record(user, "k-done"); rec == nil || rec.Response == nil {
			t.Errorf("the completed key changed: %+v", rec)
		}
	})

	t.Run("lease ended just now", func(t *testing.T) {
		e.claim(user, "k-recent", time.Hour)
		e.endLease(user, "k-recent", time.Second)
		code, out, errs := e.purge(user, "k-recent")
		wantRefused(t, "purge of a key whose lease just ended", code, out, errs, "refused", "may still be paying", "nothing purged")
		if e.record(user, "k-recent") == nil {
			t.Errorf("the key was purged")
		}
	})

	t.Run("paid without an order", func(t *testing.T) {
		l := e.claim(user, "k-paid", time.Hour)
		e.endLease(user, "k-paid", time.Hour)
		orderID := orders.OrderID(user, "k-paid", l.CreatedAt)
		res, err := e.pay.Pay(ctx, orders.PaymentRequest{Amount: 100, Currency: "EUR",
			IdempotencyKey: orders.PaymentKey(user, "k-paid", l.CreatedAt), OrderRef: orderID})
		if err != nil {
			t.Fatal(err)
		}
		code, out, errs := e.purge(user, "k-paid")
		wantRefused(t, "purge of a key whose payment has no order", code, out, errs,
			"refused", res.ID, "has no order", "orders keys redrive", "nothing purged")
		if e.record(user, "k-paid") == nil {
			t.Errorf("the key was purged")
		}
	})

	t.Run("payment not final", func(t *testing.T) {
		// The gateway (an external one, as Stripe) holds a payment of the
		// operation that is not final yet: the attempt's charge answered
		// "processing" (or waits for an action or a capture), so the
		// handler answered 502 and the key was abandoned. That payment may
		// still succeed: purging would let the retry pay again with a new
		// payment key, and the first payment would have no order.
		const extKey = "sk_test_external"
		ledger := payments.NewMemLedger()
		gw := httptest.NewServer(payments.NewServer(payments.Config{APIKey: extKey, Ledger: ledger}))
		defer gw.Close()
		for i, status := range []string{"processing", "requires_action", "requires_capture", "requires_confirmation"} {
			key := "k-pending-" + status
			l := e.claim(user, key, time.Hour)
			e.endLease(user, key, time.Hour)
			pi := &payments.PaymentIntent{ID: fmt.Sprintf("pi_pending%016d", i), Object: "payment_intent", Amount: 100, Currency: "eur",
				Created: time.Now().Unix(), Status: status, Account: payments.AccountFor(extKey),
				Metadata: map[string]string{"order_ref": orders.OrderID(user, key, l.CreatedAt)}}
			if err := ledger.Create(ctx, pi); err != nil {
				t.Fatal(err)
			}
			code, out, errs := e.purge(user, key, "--payments-url", gw.URL, "--payments-key", extKey)
			wantRefused(t, "purge of a key whose payment is "+status, code, out, errs, "refused", pi.ID, status, "nothing purged")
			if e.record(user, key) == nil {
				t.Errorf("the key whose payment is %s was purged", status)
			}
		}
		// A payment that moved no money and never will (canceled, or
		// declined) does not keep the key.
		for i, status := range []string{"canceled", "requires_payment_method"} {
			key := "k-unpaid-" + status
			l := e.claim(user, key, time.Hour)
			e.endLease(user, key, time.Hour)
			pi := &payments.PaymentIntent{ID: fmt.Sprintf("pi_unpaid%017d", i), Object: "payment_intent", Amount: 100, Currency: "eur",
				Created: time.Now().Unix(), Status: status, Account: payments.AccountFor(extKey),
				Metadata: map[string]string{"order_ref": orders.OrderID(user, key, l.CreatedAt)}}
			if err := ledger.Create(ctx, pi); err != nil {
				t.Fatal(err)
			}
			if code, out, errs := e.purge(user, key, "--payments-url", gw.URL, "--payments-key", extKey); code != 0 || !strings.Contains(out, "purged") {
				t.Errorf("purge of a key whose payment is %s: exit %d\n%s%s; want it purged", status, code, out, errs)
			}
		}
	})

	t.Run("order without an answer", func(t *testing.T) {
		if s, b := postBody(t, e.url, user, "k-ordered", orderBody(2)); s != http.StatusCreated {
			t.Fatalf("order: %d %s", s, b)
		}
		// The key loses its answer (an operator's hand, a restore): its
		// order exists.
		e.sql(`UPDATE idempotency_keys SET response_status = NULL, response_header = NULL, response_body = NULL, completed_at = NULL
			WHERE user_id = $1 AND key = $2`, user, "k-ordered")
		e.endLease(user, "k-ordered", time.Hour)
		code, out, errs := e.purge(user, "k-ordered")
		wantRefused(t, "purge of a key whose order exists", code, out, errs, "refused", "order", "exists", "nothing purged")
		if e.record(user, "k-ordered") == nil {
			t.Errorf("the key was purged")
		}
	})

	t.Run("gateway cannot be asked", func(t *testing.T) {
		e.claim(user, "k-nogw", time.Hour)
		e.endLease(user, "k-nogw", time.Hour)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		ln.Close() // nothing listens there now
		code, out, errs := e.purge(user, "k-nogw", "--payments-url", "http://"+addr)
		wantRefused(t, "purge with the gateway down", code, out, errs, "refused", "gateway", "nothing purged")
		if e.record(user, "k-nogw") == nil {
			t.Errorf("the key was purged")
		}
	})

	t.Run("another operation", func(t *testing.T) {
		e.claim(user, "k-op", time.Hour)
		e.endLease(user, "k-op", time.Hour)
		code, out, errs := e.purge(user, "k-op", "--operation", "0123456789abcdef")
		wantRefused(t, "purge with another --operation", code, out, errs, "refused", "0123456789abcdef", "nothing purged")
		if e.record(user, "k-op") == nil {
			t.Errorf("the key was purged")
		}
	})

	t.Run("no key", func(t *testing.T) {
		code, out, errs := e.purge(user, "k-none")
		wantRefused(t, "purge of an unknown key", code, out, errs, "has no key")
	})

	t.Run("abandoned, then the retry runs again", func(t *testing.T) {
		const key = "k-retry"
		e.flaky.down.Store(true)
		if s, b := postBody(t, e.url, user, key, orderBody(3)); s != http.StatusBadGateway {
			t.Fatalf("order with the gateway down: %d %s; want 502", s, b)
		}
		e.flaky.down.Store(false)
		old := e.record(user, key)
		if old == nil || old.Response != nil {
			t.Fatalf("record after the 502: %+v; want one without an answer", old)
		}
		e.endLease(user, key, time.Hour)
		op := idemdriver.OperationID(user, key, old.CreatedAt)
		code, out, errs := e.purge(user, key, "--operation", op)
		if code != 0 || errs != "" || !strings.Contains(out, "purged") || !strings.Contains(out, op) ||
			!strings.Contains(out, "abandoned") || !strings.Contains(out, orders.OrderID(user, key, old.CreatedAt)) {
			t.Fatalf("purge: exit %d\nstdout %q\nstderr %q\nwant the abandoned key's operation and order purged", code, out, errs)
		}
		t.Logf("orders keys purge: %s", out)
		if rec := e.record(user, key); rec != nil {
			t.Fatalf("the key is still there: %+v", rec)
		}
		if code, _, errs := e.keys("show", "--user", user, "--key", key); code != 1 || !strings.Contains(errs, "has no key") {
			t.Errorf("show after purge: exit %d, %q; want 1, no key", code, errs)
		}
		pays := e.flaky.pays.Load()
		s, b := postBody(t, e.url, user, key, orderBody(3))
		if s != http.StatusCreated {
			t.Fatalf("retry after purge: %d %s; want 201", s, b)
		}
		rec := e.record(user, key)
		if rec == nil || rec.Response == nil || rec.Attempts != 1 || !rec.CreatedAt.After(old.CreatedAt) {
			t.Fatalf("record after the retry: %+v; want a new operation, answered", rec)
		}
		if got := e.flaky.pays.Load() - pays; got != 1 {
			t.Errorf("the retry paid %d times, want 1", got)
		}
		if _, err := e.be.repo.Get(ctx, user, orders.OrderID(user, key, rec.CreatedAt)); err != nil {
			t.Errorf("the retry's order: %v", err)
		}
	})

	t.Run("given up", func(t *testing.T) {
		e.claim(user, "k-given-up", time.Hour)
		e.endLease(user, "k-given-up", time.Hour)
		e.sql(`UPDATE idempotency_keys SET redrives = $1 WHERE user_id = $2 AND key = $3`, keysBudget, user, "k-given-up")
		code, out, errs := e.purge(user, "k-given-up")
		if code != 0 || !strings.Contains(out, "given-up") {
			t.Fatalf("purge of a given-up key: exit %d\n%s%s", code, out, errs)
		}
		if e.record(user, "k-given-up") != nil {
			t.Errorf("the given-up key is still there")
		}
	})
}

// TestKeysPurgeUsageErrors: bad flags and values exit 2 with one line on
// stderr, before any database is opened.
func TestKeysPurgeUsageErrors(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name string
		env  map[string]string
		args []string
	}{
		{"without user", nil, []string{"--key", "k"}},
		{"without key", nil, []string{"--user", "alice"}},
		{"bad key", nil, []string{"--user", "alice", "--key", "a b"}},
		{"bad operation", nil, []string{"--user", "alice", "--key", "k", "--operation", "xyz"}},
		{"bad payments url", nil, []string{"--user", "alice", "--key", "k", "--payments-url", "ftp://gw"}},
		{"empty payments key", nil, []string{"--user", "alice", "--key", "k", "--payments-key", ""}},
		{"bad redis url", map[string]string{"REDIS_URL": "http://r"}, []string{"--user", "alice", "--key", "k"}},
		{"extra argument", nil, []string{"--user", "alice", "--key", "k", "now"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append(append([]string{"keys", "purge"}, tc.args...), "--data-dir", dir)
			code, out, errs := run(t, tc.env, args...)
			if code != 2 || out != "" || strings.Count(errs, "\n") != 1 {
				t.Errorf("exit %d\nstdout %q\nstderr %q\nwant exit 2, one line on stderr", code, out, errs)
			}
		})
	}
}

// TestKeysPurgeWithoutTheGatewayServePaysThrough: serve pays through an
// external gateway (--payments-url), and an attempt paid there without
// making its order. A purge run without --payments-url must not take the
// in-process gateway's ledger, which serve never used and which knows of
// no payment, for proof that nothing was paid: it refuses, naming
// --payments-url; with it, it finds the payment and refuses as well. On
// SQLite, and on PostgreSQL when TEST_DATABASE_URL is set.
func TestKeysPurgeWithoutTheGatewayServePaysThrough(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) { keysPurgeExternalGateway(t, "") })
	t.Run("postgres", func(t *testing.T) { keysPurgeExternalGateway(t, pgtest.Database(t)) })
}

func keysPurgeExternalGateway(t *testing.T, dbURL string) {
	ctx := context.Background()
	const extKey = "sk_test_external"
	gw := httptest.NewServer(payments.NewServer(payments.Config{APIKey: extKey, Logger: slog.New(slog.DiscardHandler)}))
	defer gw.Close()
	dir := t.TempDir()
	c := Config{DataDir: dir, DatabaseURL: dbURL, JWTSecret: testSecret, KeyTTL: 24 * time.Hour, KeyLease: 5 * time.Second,
		PaymentsURL: gw.URL, PaymentsKey: extKey, RequireKey: true}
	be, err := openBackend(ctx, &c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.close() })
	pay, _, err := newPayer(ctx, &c, be)
	if err != nil {
		t.Fatal(err)
	}
	const user, key = "purge-bob", "k-paid-elsewhere"
	cl, err := be.store.Claim(ctx, idemdriver.ClaimParams{User: user, Key: key, Fingerprint: "fp", Method: http.MethodPost, Path: "/v1/orders", Lease: time.Hour})
	if err != nil || cl.Lease == nil {
		t.Fatalf("Claim = %+v, %v", cl, err)
	}
	l := cl.Lease
	res, err := pay.Pay(ctx, orders.PaymentRequest{Amount: 100, Currency: "EUR",
		IdempotencyKey: orders.PaymentKey(user, key, l.CreatedAt), OrderRef: orders.OrderID(user, key, l.CreatedAt)})
	if err != nil {
		t.Fatal(err)
	}
	e := &purgeEnv{t: t, dir: dir, dbURL: dbURL, be: be}
	e.endLease(user, key, time.Hour)

	code, out, errs := e.purge(user, key)
	wantRefused(t, "purge without the --payments-url serve pays through", code, out, errs, "refused", "--payments-url", "nothing purged")
	if e.record(user, key) == nil {
		t.Fatalf("the key whose payment %s was made at the external gateway was purged", res.ID)
	}
	code, out, errs = e.purge(user, key, "--payments-url", gw.URL, "--payments-key", extKey)
	wantRefused(t, "purge with the gateway serve pays through", code, out, errs, "refused", res.ID, "has no order")
	if e.record(user, key) == nil {
		t.Errorf("the key was purged")
	}
}
