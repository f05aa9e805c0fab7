package redisfront_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/redistest"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/redisfront"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// orderService is a small order service behind idem.Middleware: its
// handler inserts an order through the claimed request's transaction and
// takes a while to answer.
type orderService struct {
	pool    *pgxpool.Pool
	front   *redisfront.Store // nil: pgstore alone
	handler http.Handler
	mw      *idem.Metrics
}

// newOrderService returns the service on a schema of t's own, with
// redisfront in front of pgstore when rdb is not nil. Its handler calls hold
// between inserting the order and answering.
func newOrderService(t testing.TB, rdb redis.UniversalClient, opts redisfront.Options, hold func(), tracer pgx.QueryTracer) *orderService {
	t.Helper()
	pool := testSchema(t, 16, tracer)
	if _, err := pool.Exec(context.Background(), `
CREATE TABLE orders (id bigserial PRIMARY KEY, idem_key text NOT NULL, body text NOT NULL)`); err != nil {
		t.Fatalf("creating orders: %v", err)
	}
	svc := &orderService{pool: pool, mw: new(idem.Metrics)}
	var store idem.Store = pgstore.New(pool, pgstore.Options{})
	if rdb != nil {
		if opts.KeyPrefix == "" {
			opts.KeyPrefix = uniquePrefix(t, rdb)
		}
		if opts.Logger == nil {
			opts.Logger = quietLogger()
		}
		svc.front = redisfront.New(rdb, store, opts)
		store = svc.front
	}
	svc.handler = idem.Middleware(store, idem.Options{
		User:    idem.SharedKeySpace,
		TTL:     time.Hour,
		Lease:   10 * time.Second,
		Metrics: svc.mw,
		Logger:  quietLogger(),
	})(orderHandler(hold))
	return svc
}

// sleeper returns a hold that sleeps d.
func sleeper(d time.Duration) func() {
	return func() { time.Sleep(d) } // not waiting for an outcome: the handler's work takes d, by design
}

func quietLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// orderHandler inserts an order through pgstore's transaction (reached as
// handlers reach it), calls hold, and answers 201 with the order's id.
func orderHandler(hold func()) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := pgTx(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		body, _ := io.ReadAll(r.Body)
		var id int64
		err = tx.QueryRow(r.Context(), `INSERT INTO orders (idem_key, body) VALUES ($1, $2) RETURNING id`,
			r.Header.Get("Idempotency-Key"), string(body)).Scan(&id)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		hold()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/v1/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id)
	})
}

// post sends one order request with key through h.
func post(h http.Handler, key string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, "/v1/orders", strings.NewReader(`{"item":"`+key+`","qty":1}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// load is a storm of duplicates: copies clients per key, each retrying
// until it gets its order.
type load struct {
	inFlight  atomic.Int64 // requests being served
	answered  atomic.Int64 // clients that got their order
	requests  atomic.Int64
	conflicts atomic.Int64 // 409s, retried
	serverErr atomic.Int64 // 5xx, retried

	mu        sync.Mutex // guards bodies and latencies
	bodies    map[string]string
	latencies []time.Duration // of every request

	// reached, if not nil, is closed when answered reaches signalAt.
	reached  chan struct{}
	signalAt int64
}

// run sends the storm through h and returns when every client got its
// order (or the deadline passed, which fails t).
func (l *load) run(t *testing.T, h http.Handler, keys, copies int) {
	t.Helper()
	l.bodies = make(map[string]string)
	deadline := time.Now().Add(60 * time.Second)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for k := range keys {
		key := fmt.Sprintf("order-%03d", k)
		for range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				for time.Now().Before(deadline) {
					l.inFlight.Add(1)
					began := time.Now()
					rec := post(h, key)
					took := time.Since(began)
					l.inFlight.Add(-1)
					l.requests.Add(1)
					l.mu.Lock()
					l.latencies = append(l.latencies, took)
					l.mu.Unlock()
					switch code := rec.Code; {
					case code == http.StatusCreated:
						if n := l.answered.Add(1); l.reached != nil && n == l.signalAt {
							close(l.reached)
						}
						l.mu.Lock()
						defer l.mu.Unlock()
						if prev, ok := l.bodies[key]; ok && prev != rec.Body.String() {
							t.Errorf("%s: got %s, another copy got %s", key, rec.Body, prev)
						}
						l.bodies[key] = rec.Body.String()
						return
					case code == http.StatusConflict:
						l.conflicts.Add(1)
					case code >= 500:
						l.serverErr.Add(1)
					default:
						t.Errorf("%s: %d %s", key, code, rec.Body)
						return
					}
					time.Sleep(5 * time.Millisecond) // a client's pause before it retries; the loop ends at its answer or the deadline
				}
				t.Errorf("%s: no order before the deadline", key)
			}()
		}
	}
	close(start)
	wg.Wait()
}

// percentile returns the p-th percentile of the latencies.
func (l *load) percentile(p float64) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.latencies) == 0 {
		return 0
	}
	s := slices.Clone(l.latencies)
	slices.Sort(s)
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

// checkOneOrderPerKey fails t unless every one of keys keys has exactly one
// order.
func checkOneOrderPerKey(t *testing.T, pool *pgxpool.Pool, keys int) {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT idem_key, count(*) FROM orders GROUP BY idem_key`)
	if err != nil {
		t.Fatal(err)
	}
	counts, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (int, error) {
		var k string
		var n int
		err := r.Scan(&k, &n)
		if err == nil && n != 1 {
			t.Errorf("%s: %d orders, want 1", k, n)
		}
		return n, err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(counts) != keys {
		t.Errorf("%d keys have orders, want %d", len(counts), keys)
	}
}

func logFront(t *testing.T, m *redisfront.Metrics) {
	t.Helper()
	t.Logf("redisfront: %d redis errors, %d replays and %d 409s from redis, %d inner claims, %d fills, %d locks",
		m.RedisErrors.Load(), m.ReplaysFromRedis.Load(), m.InFlightFromRedis.Load(),
		m.InnerClaims.Load(), m.CacheFills.Load(), m.LocksSet.Load())
}

// stormTimeout is the Redis timeout of the storm tests: 800 clients
// starting at once keep a small machine's CPUs so busy that a Redis call
// can take longer than the default 50ms, and Redis would then hardly
// serve before it is killed or flushed.
const stormTimeout = 500 * time.Millisecond

// TestRedisKilledMidStorm kills the Redis (SIGKILL) while 100 keys are
// each sent by 8 clients at once: requests go on against PostgreSQL alone,
// no request fails, and every key gets exactly one order.
func TestRedisKilledMidStorm(t *testing.T) {
	redistest.URL(t, "redisfront")
	srv := startRedis(t, false)
	rdb := redis.NewClient(&redis.Options{Addr: srv.addr, MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	svc := newOrderService(t, rdb, redisfront.Options{Timeout: stormTimeout}, sleeper(20*time.Millisecond), nil)

	const keys, copies = 100, 8
	l := load{reached: make(chan struct{}), signalAt: keys * copies / 4}
	var inFlightAtKill, answeredAtKill int64
	killed, ran := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(killed)
		select {
		case <-l.reached:
		case <-ran:
			select {
			case <-l.reached:
			default:
				return // the storm ended short of a quarter answered: run failed t
			}
		}
		srv.cmd.Process.Kill()
		inFlightAtKill, answeredAtKill = l.inFlight.Load(), l.answered.Load()
	}()
	l.run(t, svc.handler, keys, copies)
	close(ran)
	<-killed

	t.Logf("killed Redis with %d requests in flight, %d of %d clients answered; %d requests, %d 409s, %d 5xx",
		inFlightAtKill, answeredAtKill, keys*copies, l.requests.Load(), l.conflicts.Load(), l.serverErr.Load())
	logFront(t, svc.front.Metrics())
	if n := l.serverErr.Load(); n > inFlightAtKill {
		t.Errorf("%d 5xx answers, more than the %d requests in flight when Redis died", n, inFlightAtKill)
	}
	if svc.front.Metrics().RedisErrors.Load() == 0 {
		t.Errorf("no Redis error counted: Redis was not killed mid-storm")
	}
	checkOneOrderPerKey(t, svc.pool, keys)
}

// TestRedisFlushedMidStorm empties Redis (FLUSHALL, and every other time
// its script cache) every 25ms while a storm of duplicates runs: every key
// still gets exactly one order.
func TestRedisFlushedMidStorm(t *testing.T) {
	redistest.URL(t, "redisfront")
	srv := startRedis(t, false)
	rdb := redis.NewClient(&redis.Options{Addr: srv.addr})
	t.Cleanup(func() { rdb.Close() })
	svc := newOrderService(t, rdb, redisfront.Options{Timeout: stormTimeout}, sleeper(20*time.Millisecond), nil)

	const keys, copies = 100, 8
	var l load
	var flushes []string
	stop, flushed := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(flushed)
		ctx := context.Background()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(25 * time.Millisecond):
			}
			inFlight := l.inFlight.Load()
			err := rdb.FlushAll(ctx).Err()
			if err == nil && i%2 == 1 {
				err = rdb.ScriptFlush(ctx).Err()
			}
			if err != nil {
				t.Errorf("FLUSHALL: %v", err)
			}
			flushes = append(flushes, fmt.Sprintf("%d/%d", inFlight, l.answered.Load()))
		}
	}()
	l.run(t, svc.handler, keys, copies)
	close(stop)
	<-flushed

	t.Logf("flushed Redis %d times (requests in flight/clients answered at each: %s); %d requests, %d 409s, %d 5xx",
		len(flushes), strings.Join(flushes, " "),
		l.requests.Load(), l.conflicts.Load(), l.serverErr.Load())
	logFront(t, svc.front.Metrics())
	if n := l.serverErr.Load(); n != 0 {
		t.Errorf("%d 5xx answers, want none", n)
	}
	checkOneOrderPerKey(t, svc.pool, keys)
}

// TestRedisSlow puts a proxy that delays every chunk by 200ms between the
// Store and Redis, whose calls then all time out (50ms): every request is
// still answered, by PostgreSQL, each within a few Redis timeouts of the
// time it takes without Redis.
func TestRedisSlow(t *testing.T) {
	redistest.URL(t, "redisfront")
	srv := startRedis(t, false)
	proxy := startDelayProxy(t, srv.addr, 200*time.Millisecond)
	rdb := redis.NewClient(&redis.Options{Addr: proxy, MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })

	const keys, copies = 30, 4
	var base load
	plain := newOrderService(t, nil, redisfront.Options{}, sleeper(20*time.Millisecond), nil)
	base.run(t, plain.handler, keys, copies)
	checkOneOrderPerKey(t, plain.pool, keys)

	var slow load
	svc := newOrderService(t, rdb, redisfront.Options{Timeout: 50 * time.Millisecond}, sleeper(20*time.Millisecond), nil)
	began := time.Now()
	slow.run(t, svc.handler, keys, copies)
	took := time.Since(began)
	checkOneOrderPerKey(t, svc.pool, keys)

	t.Logf("without Redis: %d requests, median %v, p99 %v, max %v",
		base.requests.Load(), base.percentile(0.5), base.percentile(0.99), base.percentile(1))
	t.Logf("Redis behind a 200ms proxy, 50ms timeout: %d requests in %v, median %v, p99 %v, max %v; %d 409s, %d 5xx",
		slow.requests.Load(), took.Round(time.Millisecond), slow.percentile(0.5), slow.percentile(0.99), slow.percentile(1),
		slow.conflicts.Load(), slow.serverErr.Load())
	logFront(t, svc.front.Metrics())
	if n := slow.serverErr.Load(); n != 0 {
		t.Errorf("%d 5xx answers, want none", n)
	}
	if svc.front.Metrics().RedisErrors.Load() == 0 {
		t.Errorf("no Redis call timed out: the proxy did not slow Redis down")
	}
	// A claim makes one Redis call before it falls back, a completion one:
	// a request should take about 100ms more than without Redis. The bound
	// is generous, for loaded machines.
	if max := slow.percentile(1); max > 5*time.Second {
		t.Errorf("slowest request took %v", max)
	}
}

// startDelayProxy starts a TCP proxy to target that holds every chunk it
// forwards, in either direction, for delay. It returns its address.
func startDelayProxy(t testing.TB, target string, delay time.Duration) string {
	t.Helper()
	return serveLoopback(t, func(in net.Conn, track func(net.Conn)) {
		out, err := net.Dial("tcp", target)
		if err != nil {
			in.Close()
			return
		}
		track(out)
		go delayCopy(out, in, delay)
		delayCopy(in, out, delay)
	})
}

// delayCopy copies src to dst, each chunk delay after it was read; chunks
// keep their order and their delays overlap.
func delayCopy(dst, src net.Conn, delay time.Duration) {
	type chunk struct {
		b  []byte
		at time.Time
	}
	ch := make(chan chunk, 1024)
	go func() {
		defer close(ch)
		for {
			b := make([]byte, 32<<10)
			n, err := src.Read(b)
			if n > 0 {
				ch <- chunk{b[:n], time.Now().Add(delay)}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range ch {
		time.Sleep(time.Until(c.at)) // not waiting for an outcome: the network delay injected, by design
		if _, err := dst.Write(c.b); err != nil {
			break
		}
	}
	dst.Close()
	src.Close()
}
