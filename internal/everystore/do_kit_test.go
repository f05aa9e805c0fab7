package everystore_test

// The stores idem.Do's tests run on (issue 14): each with a table of
// effects written through the store's own FromContext accessor, as a
// DoFunc would, and a clock the tests move (leases and backoffs pass on
// it, never on the wall clock).

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/redisfront"
	"github.com/idem-go/idem/sqlitestore"
	"github.com/idem-go/idem/storetest"
)

// doKit is one store under test.
type doKit struct {
	kind  string
	store idemdriver.SweepingStore
	clk   *storetest.Clock
	// write records effect name in the transaction of the Do operation
	// (or request) ctx belongs to, through the store's FromContext.
	write func(ctx context.Context, name string) error
	// count reports how many effects named name committed.
	count func(t *testing.T, name string) int
}

// doKinds are the stores the tests run on; "pg" and "redis-pg" skip
// without TEST_DATABASE_URL (and TEST_REDIS_URL) outside CI.
var doKinds = []string{"mem", "sqlite", "pg", "redis-pg"}

// doStart is the clocks' start: a whole second, as storetest's.
var doStart = time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

func newDoKit(t *testing.T, kind string) *doKit {
	t.Helper()
	ctx := context.Background()
	k := &doKit{kind: kind, clk: storetest.NewClock(doStart)}
	now := k.clk.Now
	switch kind {
	case "mem":
		var mu sync.Mutex
		effects := map[string]int{}
		k.store = memstore.New(memstore.Options{Now: now})
		k.write = func(ctx context.Context, name string) error {
			tx, err := memstore.FromContext(ctx)
			if err != nil {
				return err
			}
			tx.OnCommit(func() { mu.Lock(); effects[name]++; mu.Unlock() })
			return nil
		}
		k.count = func(_ *testing.T, name string) int { mu.Lock(); defer mu.Unlock(); return effects[name] }
	case "sqlite":
		s, err := sqlitestore.Open(ctx, filepath.Join(t.TempDir(), "do.db"), sqlitestore.Options{Now: now})
		if err != nil {
			t.Fatalf("sqlitestore.Open: %v", err)
		}
		t.Cleanup(func() { s.Close() })
		if _, err := s.DB().Exec(`CREATE TABLE do_effects (name TEXT NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		k.store = s
		k.write = func(ctx context.Context, name string) error {
			tx, err := sqlitestore.FromContext(ctx)
			if err != nil {
				return err
			}
			_, err = tx.ExecContext(ctx, `INSERT INTO do_effects (name) VALUES (?)`, name)
			return err
		}
		k.count = func(t *testing.T, name string) int {
			t.Helper()
			var n int
			if err := s.DB().QueryRow(`SELECT count(*) FROM do_effects WHERE name = ?`, name).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
	case "pg", "redis-pg":
		pool := pgtest.Pool(t, pgtest.MaxConns(40))
		if err := pgstore.Migrate(ctx, pool); err != nil {
			t.Fatalf("Migrate: %v", err)
		}
		if _, err := pool.Exec(ctx, `CREATE TABLE do_effects (name text NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		k.store = pgstore.New(pool, pgstore.Options{Now: now})
		if kind == "redis-pg" {
			k.store = redisfront.New(doRedis(t), k.store, redisfront.Options{Timeout: 2 * time.Second, KeyPrefix: doPrefix(), Now: now})
		}
		k.write = func(ctx context.Context, name string) error {
			tx, err := pgstore.FromContext(ctx)
			if err != nil {
				return err
			}
			_, err = tx.Exec(ctx, `INSERT INTO do_effects (name) VALUES ($1)`, name)
			return err
		}
		k.count = func(t *testing.T, name string) int {
			t.Helper()
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM do_effects WHERE name = $1`, name).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
	default:
		t.Fatalf("unknown kind %s", kind)
	}
	return k
}

// doRedis returns a client of the Redis of TEST_REDIS_URL, or skips t.
func doRedis(t *testing.T) *redis.Client {
	t.Helper()
	u := os.Getenv("TEST_REDIS_URL")
	if u == "" {
		if os.Getenv("CI") != "true" {
			t.Skip("Redis cases skipped: set TEST_REDIS_URL (e.g. redis://127.0.0.1:6379) or CI=true")
		}
		u = "redis://127.0.0.1:6379"
	}
	opt, err := redis.ParseURL(u)
	if err != nil {
		t.Fatalf("TEST_REDIS_URL %q: %v", u, err)
	}
	opt.ContextTimeoutEnabled = true
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { rdb.Close() })
	return rdb
}

// doPrefix is a Redis key prefix of one test's own. Its keys expire with
// their records' TTL (an hour at most in these tests).
func doPrefix() string {
	var b [6]byte
	rand.Read(b[:])
	return "dotest:" + hex.EncodeToString(b[:]) + ":"
}

// forDoKinds runs fn on a fresh store of every kind, in parallel.
func forDoKinds(t *testing.T, fn func(t *testing.T, k *doKit)) {
	for _, kind := range doKinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			fn(t, newDoKit(t, kind))
		})
	}
}

// doParams is a Do operation of the tests' user.
func doParams(key, op, input string) idem.DoParams {
	return idem.DoParams{User: "consumer:test", Key: key, Operation: op, Input: []byte(input), Lease: 10 * time.Second, TTL: time.Hour, Logger: doQuiet}
}

// errDoBoom is a DoFunc's own failure.
var errDoBoom = errors.New("boom: downstream refused")

// doRecord returns the record of p's key.
func doRecord(t *testing.T, k *doKit, p idem.DoParams) *idemdriver.Record {
	t.Helper()
	rec, err := k.store.Get(context.Background(), p.User, p.Key)
	if err != nil {
		t.Fatalf("Get(%s/%s): %v", p.User, p.Key, err)
	}
	return rec
}

// doOutput is a DoFunc's output naming its run.
func doOutput(run string) []byte { return fmt.Appendf(nil, `{"run":%q}`, run) }
