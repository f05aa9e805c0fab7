package ordersapp

// Regression test from the third adversarial review of issue 8, on the
// assembled service. It failed on main as of 970c2de.

import (
	"context"
	"io"
	"log/slog"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/pgtest"
)

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
	redisURL := redisURL(t)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))

	// Deployment A's database, migrated (serve migrates at start).
	dbA := pgtest.Database(t)
	// One data dir per deployment: an instance on another one would run
	// an embedded NATS of its own, which its database refuses.
	dirs := map[string]string{}
	cfg := func(db string) *Config {
		if dirs[db] == "" {
			dirs[db] = t.TempDir()
		}
		return &Config{DataDir: dirs[db], DatabaseURL: db, RedisURL: redisURL, JWTSecret: testSecret,
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
	// A copy of a database records the stream of the original's
	// events; deployment B has an embedded NATS of its own: its operator
	// forgets the original's stream first (see the README).
	pgExec(t, dbB, `DELETE FROM event_stream`)

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
	wantDeploymentsApart(t, bases[0], bases[1], dbB, "cloned-", "deployment B (a copy of A's database, one Redis)")
}
