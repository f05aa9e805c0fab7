package redisfront_test

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem/redisfront"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// statementCounter is a pgx.QueryTracer that counts the statements a pool
// sends.
type statementCounter struct{ n atomic.Int64 }

func (c *statementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c *statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestDuplicatesSkipPostgres counts the statements PostgreSQL receives
// while a first request holds its key and 100 duplicates arrive (all 409),
// and then while 100 repeats of the completed request arrive (all
// replays): none with Redis in front; with PostgreSQL alone, for
// comparison, some per duplicate.
func TestDuplicatesSkipPostgres(t *testing.T) {
	for _, tc := range []struct {
		name  string
		redis bool
	}{{"postgres", false}, {"redis", true}} {
		t.Run(tc.name, func(t *testing.T) {
			var rdb redis.UniversalClient
			if tc.redis {
				rdb = newRedis(t)
			}
			var stmts statementCounter
			started, release := make(chan struct{}), make(chan struct{})
			var (
				once  sync.Once
				armed atomic.Bool
			)
			hold := func() {
				if armed.Load() {
					once.Do(func() { close(started) })
					<-release
				}
			}
			// What is measured is the protocol, not this loaded machine: a
			// Redis call that overran the default 50ms, or a lock that ran
			// out (LockTTL) mid-storm, would send a duplicate on to
			// PostgreSQL by design.
			svc := newOrderService(t, rdb, redisfront.Options{Timeout: time.Second, LockTTL: time.Minute}, hold, &stmts)
			if rdb != nil {
				// A first call loads the scripts, as any earlier request
				// of a running service would have.
				post(svc.handler, "warm-up")
			}
			armed.Store(true)

			first := make(chan int)
			go func() { first <- post(svc.handler, "k-first").Code }()
			<-started

			const n = 100
			before := stmts.n.Load()
			duplicates(t, svc, n, http.StatusConflict)
			inFlight := stmts.n.Load() - before

			close(release)
			if code := <-first; code != http.StatusCreated {
				t.Fatalf("first request: %d, want 201", code)
			}
			before = stmts.n.Load()
			duplicates(t, svc, n, http.StatusCreated)
			replays := stmts.n.Load() - before

			t.Logf("%s: %d statements for %d in-flight duplicates, %d for %d replays", tc.name, inFlight, n, replays, n)
			if tc.redis {
				if inFlight != 0 || replays != 0 {
					t.Errorf("statements with Redis in front: %d for the in-flight duplicates, %d for the replays; want 0 and 0", inFlight, replays)
				}
				m := svc.front.Metrics()
				if m.InFlightFromRedis.Load() != n || m.ReplaysFromRedis.Load() != n {
					t.Errorf("Redis answered %d in flight and %d replays, want %d and %d", m.InFlightFromRedis.Load(), m.ReplaysFromRedis.Load(), n, n)
				}
			}
		})
	}
}

// duplicates sends n copies of the request with key k-first at once and
// fails t unless each is answered want.
func duplicates(t *testing.T, svc *orderService, n, want int) {
	t.Helper()
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if rec := post(svc.handler, "k-first"); rec.Code != want {
				t.Errorf("duplicate: %d %s, want %d", rec.Code, rec.Body, want)
			}
		}()
	}
	wg.Wait()
}

// BenchmarkReplay replays a completed request through idem.Middleware,
// from PostgreSQL alone and from Redis in front of it, with a client that
// honours context deadlines (redis) and one that does not (redis-guarded:
// each Redis call on a goroutine of its own).
func BenchmarkReplay(b *testing.B) {
	for _, name := range []string{"postgres", "redis", "redis-guarded"} {
		b.Run(name, func(b *testing.B) {
			var rdb redis.UniversalClient
			switch name {
			case "redis":
				rdb = newRedisWith(b, true)
			case "redis-guarded":
				rdb = newRedisWith(b, false)
			}
			svc := newOrderService(b, rdb, redisfront.Options{}, func() {}, nil)
			if rec := post(svc.handler, "k-replay"); rec.Code != http.StatusCreated {
				b.Fatalf("first request: %d %s", rec.Code, rec.Body)
			}
			b.ResetTimer()
			for range b.N {
				rec := post(svc.handler, "k-replay")
				if rec.Code != http.StatusCreated || rec.Header().Get("Idempotent-Replayed") != "true" {
					b.Fatalf("replay: %d %v", rec.Code, rec.Header())
				}
			}
			b.StopTimer()
			if svc.front != nil {
				if got := svc.front.Metrics().ReplaysFromRedis.Load(); got != int64(b.N) {
					b.Errorf("replays from Redis = %d, want %d", got, b.N)
				}
			}
		})
	}
}
