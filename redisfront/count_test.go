package redisfront_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/redisfront"
	"github.com/redis/go-redis/v9"
)

// countCost is what one request cost.
type countCost struct {
	PGStatements int // statements sent to PostgreSQL
	PGRoundTrips int // writes to PostgreSQL's socket
	PGCommits    int // COMMITs plus statements outside a transaction
	RedisCalls   int // Redis commands (an EVALSHA refused with NOSCRIPT, sent again as EVAL by go-redis, not counted)
	RedisTrips   int // Redis round trips: commands sent alone plus pipelines
}

// countMeter counts Redis commands (it is the client's hook), and on
// PostgreSQL through pg, a pgtest.Counter on the pool.
type countMeter struct {
	pg *pgtest.Counter

	mu    sync.Mutex
	redis countCost // RedisCalls and RedisTrips only
	trace []string  // the Redis commands since the last snapshot
}

func (m *countMeter) note(s string) {
	m.trace = append(m.trace, s)
}

func (m *countMeter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (m *countMeter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		m.mu.Lock()
		defer m.mu.Unlock()
		if strings.EqualFold(cmd.Name(), "evalsha") && err != nil && strings.HasPrefix(err.Error(), "NOSCRIPT") {
			m.note("redis: evalsha refused (NOSCRIPT)")
			return err
		}
		m.redis.RedisCalls++
		m.redis.RedisTrips++
		m.note("redis: " + cmd.Name())
		return err
	}
}

func (m *countMeter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		m.mu.Lock()
		m.redis.RedisCalls += len(cmds)
		m.redis.RedisTrips++
		m.note(fmt.Sprintf("redis: pipeline of %d", len(cmds)))
		m.mu.Unlock()
		return next(ctx, cmds)
	}
}

// countMark is where a request began: both counters' totals.
type countMark struct {
	pg    pgtest.Tally
	redis countCost
}

func (m *countMeter) snapshot() countMark {
	pg := m.pg.Snapshot()
	m.mu.Lock()
	defer m.mu.Unlock()
	m.trace = nil
	return countMark{pg, m.redis}
}

// since is what was spent since mark, and the statements and Redis
// commands sent meanwhile.
func (m *countMeter) since(mark countMark) (countCost, []string) {
	trace := m.pg.Statements()
	pg := m.pg.Snapshot().Minus(mark.pg)
	m.mu.Lock()
	defer m.mu.Unlock()
	return countCost{
		PGStatements: pg.Statements, PGRoundTrips: pg.RoundTrips, PGCommits: pg.Commits,
		RedisCalls: m.redis.RedisCalls - mark.redis.RedisCalls, RedisTrips: m.redis.RedisTrips - mark.redis.RedisTrips,
	}, append(trace, m.trace...)
}

const countRequestBody = `{"sku":"sku_42","quantity":1,"currency":"eur"}`

func countRequest(key string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(countRequestBody))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("Idempotency-Key", key)
	return r
}

// TestCountRedisFrontPerRequest asserts today's cost of a create, a
// replay and a 409 through redisfront in front of pgstore.
func TestCountRedisFrontPerRequest(t *testing.T) {
	m := &countMeter{pg: pgtest.NewCounter()}
	rdb := newRedis(t)
	rdb.AddHook(m)
	pool := pgtest.CountingPool(t, m.pg)
	ctx := context.Background()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE countfx (id bigserial PRIMARY KEY, note text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	front := redisfront.New(rdb, pgstore.New(pool, pgstore.Options{}), redisfront.Options{
		KeyPrefix: uniquePrefix(t, rdb), Logger: slog.New(slog.DiscardHandler),
		// Generous bounds, so that a loaded machine cannot turn a Redis
		// answer into a fallback or let the held key's lock lapse: the
		// counts do not depend on them.
		Timeout: 10 * time.Second, LockTTL: time.Minute,
	})
	h := idem.Middleware(front, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := pgstore.FromContext(r.Context())
		if err == nil {
			_, err = tx.Exec(r.Context(), `INSERT INTO countfx (note) VALUES ($1)`, "order")
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{"id":"ord_0123456789abcdef","object":"order","status":"created","amount":1999,"currency":"eur"}`))
	}))
	hold := func(key string) {
		r := countRequest(key)
		fp, err := idem.Fingerprint(r, []byte(countRequestBody))
		if err != nil {
			t.Fatal(err)
		}
		c, err := front.Claim(ctx, idemdriver.ClaimParams{Key: key, Owner: idemdriver.NewOwner(), Fingerprint: fp,
			Method: r.Method, Path: r.URL.RequestURI(), Body: []byte(countRequestBody), Lease: idem.DefaultLease, TTL: idem.DefaultTTL})
		if err != nil || c.Lease == nil {
			t.Fatalf("holding %s: %+v, %v", key, c, err)
		}
	}
	serve := func(key string) (int, countCost, []string) {
		before := m.snapshot()
		w := httptest.NewRecorder()
		h.ServeHTTP(w, countRequest(key))
		c, trace := m.since(before)
		return w.Code, c, trace
	}
	want := map[string]countCost{
		"create":   {PGStatements: 5, PGRoundTrips: 3, PGCommits: 2, RedisCalls: 3, RedisTrips: 3},
		"replay":   {RedisCalls: 1, RedisTrips: 1},
		"inflight": {RedisCalls: 1, RedisTrips: 1},
	}
	for i := range 4 { // round 0 warms the connections, the statement cache and Redis's script cache
		key, held := fmt.Sprintf("count-%d", i), fmt.Sprintf("count-held-%d", i)
		for _, step := range []struct {
			name, key string
			code      int
		}{{"create", key, http.StatusCreated}, {"replay", key, http.StatusCreated}, {"inflight", held, http.StatusConflict}} {
			if step.name == "inflight" {
				hold(step.key)
			}
			code, got, trace := serve(step.key)
			if code != step.code {
				t.Fatalf("round %d, %s: status %d, want %d; calls: %q", i, step.name, code, step.code, trace)
			}
			if i == 0 {
				t.Logf("first %s (cold): %+v", step.name, got)
				continue
			}
			t.Logf("%s: %+v", step.name, got)
			if got != want[step.name] {
				t.Errorf("round %d: %s costs %+v\nwant %+v\ncalls: %q\n(today's minimum: a change that lowers it must lower this assertion; one that raises it is a regression)",
					i, step.name, got, want[step.name], trace)
			}
		}
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM countfx`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != 4 {
		t.Fatalf("%d rows in countfx, want 4 (one per create)", rows)
	}
	if n := front.Metrics().RedisErrors.Load(); n != 0 {
		t.Fatalf("%d Redis errors: the counts above are not the Redis path's", n)
	}
}
