package ordersapp

// Regression test from the third adversarial review of issue 8, on the
// assembled service. It failed on main as of 970c2de.

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/pgtest"
)

// review3Redis returns the Redis of the tests, or skips.
func review3Redis(t *testing.T) string {
	t.Helper()
	u := os.Getenv("TEST_REDIS_URL")
	if u == "" {
		if os.Getenv("CI") != "true" {
			t.Skip("set TEST_REDIS_URL or CI=true")
		}
		u = "redis://127.0.0.1:6379"
	}
	return u
}

// TestReview3ClonedDatabaseSharesRedisPrefix: the Redis prefix is a random
// id kept as a row of the database (table deployment), so it travels with
// the data: a database made from another (CREATE DATABASE … TEMPLATE, a
// pg_dump restored, a SQLite file or data dir copied — how a staging
// database is commonly made from production's) carries the same id. Two
// such deployments that share one Redis (the case 13fdec4 was for:
// staging and production on one managed Redis) share every entry again:
// deployment B replays, byte for byte, an answer of deployment A that B's
// database never saw, charges nothing and makes no order.
func TestReview3ClonedDatabaseSharesRedisPrefix(t *testing.T) {
	ctx := context.Background()
	redisURL := review3Redis(t)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))

	// Deployment A's database, migrated (serve migrates at start).
	dbA := pgtest.Database(t)
	cfg := func(db string) *Config {
		return &Config{DataDir: t.TempDir(), DatabaseURL: db, RedisURL: redisURL, JWTSecret: testSecret,
			KeyTTL: time.Hour, KeyLease: 2 * time.Second, PaymentsKey: "sk_test_local", RequireKey: true}
	}
	srvA, err := (&App{}).newServer(ctx, cfg(dbA), quiet)
	if err != nil {
		t.Fatal(err)
	}
	srvA.close()

	// Deployment B's database: a copy of A's, made before A took traffic.
	admin := pgtest.URL(t)
	ua, _ := url.Parse(dbA)
	nameA := strings.TrimPrefix(ua.Path, "/")
	nameB := nameA + "_clone"
	pgExec(t, admin, "CREATE DATABASE "+nameB+" TEMPLATE "+nameA)
	t.Cleanup(func() { pgExec(t, admin, "DROP DATABASE IF EXISTS "+nameB+" WITH (FORCE)") })
	ub := *ua
	ub.Path = "/" + nameB
	dbB := ub.String()

	var bases []string
	for _, db := range []string{dbA, dbB} {
		srv, err := (&App{}).newServer(ctx, cfg(db), quiet)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.close)
		hs := httptest.NewServer(srv.handler)
		t.Cleanup(hs.Close)
		bases = append(bases, hs.URL)
	}
	user := "cloned-" + idem.NewOwner()[:12]
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
	if s, _, b := send(bases[0]); s != http.StatusCreated {
		t.Fatalf("deployment A: %d %s", s, b)
	}
	s, replayed, b := send(bases[1])
	ordersB := countRows(t, dbB, `SELECT count(*) FROM orders`)
	if s != http.StatusCreated || replayed == "true" || ordersB != 1 {
		t.Errorf("deployment B (a copy of A's database, one Redis): %d (Idempotent-Replayed %q), %d orders in B; "+
			"want its own order made (201, not a replay of A's answer); body %s", s, replayed, ordersB, b)
	}
}
