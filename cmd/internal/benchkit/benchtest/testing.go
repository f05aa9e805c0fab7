package benchtest

import (
	"context"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/benchkit"
	"github.com/idem-go/idem/internal/pgtest"
)

// DefaultRedisURL is the benchkit.Redis used under CI=true when TEST_REDIS_URL is unset.
const DefaultRedisURL = "redis://127.0.0.1:6379"

// RedisURL returns the tests' benchkit.Redis: TEST_REDIS_URL, or under CI=true
// DefaultRedisURL; elsewhere it skips tb.
func RedisURL(tb testing.TB) string {
	tb.Helper()
	if u := os.Getenv("TEST_REDIS_URL"); u != "" {
		return u
	}
	if os.Getenv("CI") != "true" {
		tb.Skip("Redis tests skipped: set TEST_REDIS_URL (e.g. " + DefaultRedisURL + ") or CI=true")
	}
	return DefaultRedisURL
}

// NewForTest builds the benchkit.Target of store with or without the middleware for
// a test or benchmark, taking the servers from TEST_DATABASE_URL and
// TEST_REDIS_URL (see pgtest.URL and RedisURL: skipped without them unless
// CI=true), and closes it when tb ends.
func NewForTest(tb testing.TB, store string, middleware bool) *benchkit.Target {
	tb.Helper()
	cfg := benchkit.Config{Store: store, Middleware: middleware, Dir: tb.TempDir()}
	switch store {
	case benchkit.Postgres:
		cfg.DatabaseURL = pgtest.URL(tb)
	case benchkit.Redis:
		cfg.DatabaseURL = pgtest.URL(tb)
		cfg.RedisURL = RedisURL(tb)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	t, err := benchkit.New(ctx, cfg)
	if err != nil {
		tb.Fatalf("benchkit.New(%s, middleware=%v): %v", store, middleware, err)
	}
	tb.Cleanup(func() {
		if err := t.Close(); err != nil {
			tb.Errorf("closing the %s target: %v", store, err)
		}
	})
	return t
}

// Do sends r, a request of w, through t's handler and returns the
// recorded response.
func Do(tb testing.TB, t *benchkit.Target, w *benchkit.Workload, r benchkit.Request) *httptest.ResponseRecorder {
	tb.Helper()
	req, err := w.HTTP("http://bench"+benchkit.Path, r)
	if err != nil {
		tb.Fatal(err)
	}
	rec := httptest.NewRecorder()
	t.Handler().ServeHTTP(rec, req)
	return rec
}
