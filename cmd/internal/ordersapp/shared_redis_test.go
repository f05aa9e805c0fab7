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

	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
)

// TestSharedRedisKeepsDeploymentsApart checks that two deployments on two
// databases sharing one Redis never replay or block each other's keys.
//
// It guards a bug found in the second review of issue 8, as it was found: withRedis fronts
// the store with redisfront.Options{} (the constant KeyPrefix "idem:"),
// and serve has no way to set another, so two deployments on two databases
// that share one Redis (staging and production, two regions, two tenants
// of a managed Redis) share every cache entry and lease lock: Redis
// decides for a database that never saw the key. Alice's order made on
// deployment A is replayed, byte for byte, by deployment B, which never
// ran the request, has no such order and charged nothing (her order on B
// is lost, and she is shown A's order id, payment and data); with another
// body B answers 422; while A runs, B answers 409.
func TestSharedRedisKeepsDeploymentsApart(t *testing.T) {
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
