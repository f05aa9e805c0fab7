package ordersapp

// Adversarial review of issue 8 (second review), on the assembled service.

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestReviewServeCompleterStoresUnwritableOutcome: orders.StoredStatus
// (2xx, 3xx, 402 and the handler's 422 order-not-writable) is what the
// route stores, and orders' own doc says to give it to the completer too;
// serve builds the completer from its own IdemOptions, whose Stored is nil,
// so the completer's middleware stores only idem.StoredStatus. An
// abandoned order whose row the database refuses for good is re-driven:
// paid (replayed), refused, refunded, answered 422, and the 422 is not
// stored: the key stays without an outcome, is re-driven again and again
// (each time through the gateway) until the completer gives up, and stays
// bound, unanswered and never expiring, to be re-run by any later retry
// (after the gateway forgot its keys, a new charge and a new refund).
func TestReviewServeCompleterStoresUnwritableOutcome(t *testing.T) {
	ctx := context.Background()
	db := pgtest.Database(t)
	c := Config{DataDir: t.TempDir(), DatabaseURL: db, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: 30 * time.Second,
		PaymentsKey: "sk_test_local", RequireKey: true}
	srv, err := (&App{}).newServer(ctx, &c, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close()
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	// A refusal no validation foresees (as in cmd/internal/orders' tests).
	if _, err := pool.Exec(ctx, `ALTER TABLE orders ADD CONSTRAINT test_refused_sku CHECK (NOT items @> '[{"sku":"REFUSED"}]')`); err != nil {
		t.Fatal(err)
	}
	body := `{"items":[{"sku":"REFUSED","quantity":1,"unit_price":500}],"currency":"EUR"}`
	fp, err := idem.FingerprintWithoutQuery(httptest.NewRequest("POST", "/v1/orders", nil), []byte(body)) // the order API's fingerprint
	if err != nil {
		t.Fatal(err)
	}
	// An attempt whose instance died after the claim.
	if _, err := srv.backend.store.Claim(ctx, idemdriver.ClaimParams{
		User: "alice", Key: "unwritable-1", Fingerprint: fp, Owner: idemdriver.NewOwner(),
		Method: "POST", Path: "/v1/orders", Header: http.Header{"Content-Type": {"application/json"}},
		Body: []byte(body), Lease: 50 * time.Millisecond, TTL: time.Hour,
	}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // not waiting for an outcome: PostgreSQL's clock (serve's store reads it) passes the 50ms lease
	st, err := srv.completer.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := srv.backend.store.Get(ctx, "alice", "unwritable-1")
	if err != nil {
		t.Fatal(err)
	}
	if rec.Response == nil || rec.Response.Status != http.StatusUnprocessableEntity {
		t.Errorf("after the completer (%+v): stored response %+v, attempts %d; want the final 422 order-not-writable stored, "+
			"as the route stores it", st, rec.Response, rec.Attempts)
	}
}

// TestReviewSharedRedisReplaysAnotherDeploymentsAnswer: withRedis fronts
// the store with redisfront.Options{} (the constant KeyPrefix "idem:"),
// and serve has no way to set another, so two deployments on two databases
// that share one Redis (staging and production, two regions, two tenants
// of a managed Redis) share every cache entry and lease lock: Redis
// decides for a database that never saw the key. Alice's order made on
// deployment A is replayed, byte for byte, by deployment B, which never
// ran the request, has no such order and charged nothing (her order on B
// is lost, and she is shown A's order id, payment and data); with another
// body B answers 422; while A runs, B answers 409.
func TestReviewSharedRedisReplaysAnotherDeploymentsAnswer(t *testing.T) {
	ctx := context.Background()
	rdb := redisURL(t)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	var bases []string
	var dbs []string
	for range 2 {
		db := pgtest.Database(t)
		c := Config{DataDir: t.TempDir(), DatabaseURL: db, RedisURL: rdb, JWTSecret: testSecret,
			KeyTTL: 5 * time.Second, KeyLease: 2 * time.Second, PaymentsKey: "sk_test_local", RequireKey: true}
		srv, err := (&App{}).newServer(ctx, &c, quiet)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.close)
		hs := httptest.NewServer(srv.handler)
		t.Cleanup(hs.Close)
		bases = append(bases, hs.URL)
		dbs = append(dbs, db)
	}
	wantDeploymentsApart(t, bases[0], bases[1], dbs[1], "shared-redis-", "deployment B, whose database never saw the key")
}

// wantDeploymentsApart sends one order (key order-1, a fresh user named
// after userPrefix) to deployment A, then to deployment B, which share one
// Redis: B, whose database dbB never saw the key, must make its own order
// (201, not a replay of A's answer). what names B in the error.
func wantDeploymentsApart(t *testing.T, baseA, baseB, dbB, userPrefix, what string) {
	t.Helper()
	user := userPrefix + idemdriver.NewOwner()[:12]
	send := func(base string) (int, string, string) {
		req, _ := http.NewRequest("POST", base+"/v1/orders", strings.NewReader(orderBody(1)))
		req.Header.Set("Authorization", "Bearer "+token(t, user))
		req.Header.Set("Idempotency-Key", "order-1")
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), string(b)
	}
	if s, _, b := send(baseA); s != http.StatusCreated {
		t.Fatalf("deployment A: %d %s", s, b)
	}
	s, replayed, b := send(baseB)
	ordersB := countRows(t, dbB, `SELECT count(*) FROM orders`)
	if s != http.StatusCreated || replayed == "true" || ordersB != 1 {
		t.Errorf("%s: %d (Idempotent-Replayed %q), %d orders in B; want its own order made (201, not a replay of A's answer); body %.200s",
			what, s, replayed, ordersB, b)
	}
}
