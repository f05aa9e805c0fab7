package redisfront_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/redistest"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/redisfront"
	"github.com/idem-go/idem/storetest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// newRedis returns a client of the tests' Redis (redistest.Client),
// closed when t ends, that honours context deadlines.
func newRedis(t testing.TB) *redis.Client {
	t.Helper()
	return redistest.Client(t, "redisfront")
}

// newRedisWith is newRedis with ContextTimeoutEnabled set to ctxTimeouts.
func newRedisWith(t testing.TB, ctxTimeouts bool) *redis.Client {
	t.Helper()
	return redistest.Client(t, "redisfront", func(o *redis.Options) { o.ContextTimeoutEnabled = ctxTimeouts })
}

// uniquePrefix returns a key prefix of t's own (redistest.Prefix); the
// keys under it are deleted when t ends.
func uniquePrefix(t testing.TB, rdb redis.UniversalClient) string {
	t.Helper()
	return redistest.Prefix(t, rdb, "idemtest")
}

// unwrapTx returns the transaction a wrapper such as *redisfront.Tx
// holds.
func unwrapTx(tx idem.Tx) idem.Tx {
	for {
		u, ok := tx.(interface{ Unwrap() idem.Tx })
		if !ok {
			return tx
		}
		tx = u.Unwrap()
	}
}

// pgTx is pgstore.FromContext for handlers behind redisfront: it unwraps
// the transaction, as pgstore.FromContext will once it follows Unwrap.
func pgTx(ctx context.Context) (pgx.Tx, error) {
	if tx, err := pgstore.FromContext(ctx); err == nil {
		return tx, nil
	}
	tx, err := idem.TxFromContext(ctx)
	if err != nil {
		return nil, err
	}
	ptx, ok := unwrapTx(tx).(*pgstore.Tx)
	if !ok {
		return nil, idem.ErrNoTx
	}
	return ptx.PgxTx(), nil
}

// testSchema returns a pool on a schema of t's own (dropped when t ends)
// with pgstore's table migrated. tracer, if not nil, sees every statement.
func testSchema(t testing.TB, maxConns int32, tracer pgx.QueryTracer) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t, pgtest.MaxConns(maxConns), func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracer })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	return pool
}

// memHarness is the conformance harness for redisfront in front of
// memstore, with rdb. Every store shares metrics m.
func memHarness(rdb redis.UniversalClient, m *redisfront.Metrics) storetest.Harness {
	return memHarnessWith(rdb, m, redisfront.Options{Timeout: suiteTimeout}, uniquePrefix)
}

// suiteTimeout is the Redis timeout of the conformance runs, which check
// the protocol and count every Redis error as a failure: on a loaded CI
// machine a call may overrun the default 50ms, which the failure tests
// cover on purpose.
const suiteTimeout = 2 * time.Second

// memHarnessWith is memHarness with opts, but for the Metrics, the clock
// and the KeyPrefix, which prefix returns for each store.
func memHarnessWith(rdb redis.UniversalClient, m *redisfront.Metrics, opts redisfront.Options,
	prefix func(testing.TB, redis.UniversalClient) string) storetest.Harness {
	var mu sync.Mutex // guards effects
	effects := map[string]int{}
	newAt := func(t *testing.T, now func() time.Time) idem.Store {
		o := opts
		o.KeyPrefix, o.Metrics, o.Now = prefix(t, rdb), m, now
		return redisfront.New(rdb, memstore.New(memstore.Options{Now: now}), o)
	}
	return storetest.Harness{
		New:   func(t *testing.T) idem.Store { return newAt(t, nil) },
		NewAt: newAt,
		Write: func(ctx context.Context, tx idem.Tx, name string) error {
			mtx, ok := unwrapTx(tx).(*memstore.Tx)
			if !ok {
				return fmt.Errorf("transaction %T is not a memstore one", tx)
			}
			mtx.OnCommit(func() {
				mu.Lock()
				defer mu.Unlock()
				effects[name]++
			})
			return nil
		},
		// The handler's accessor unwraps redisfront's Tx, and the inner
		// store refuses.
		HandlerCommit: func(ctx context.Context) error {
			tx, err := memstore.FromContext(ctx)
			if err != nil {
				return err
			}
			return tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK})
		},
		HandlerRollback: func(ctx context.Context) error {
			tx, err := memstore.FromContext(ctx)
			if err != nil {
				return err
			}
			return tx.Rollback(ctx)
		},
		Count: func(ctx context.Context, s idem.Store, name string) (int, error) {
			mu.Lock()
			defer mu.Unlock()
			return effects[name], nil
		},
	}
}

// pgHarness is the conformance harness for redisfront in front of pgstore,
// each store on a schema of its own, with rdb. Every store shares metrics m.
func pgHarness(rdb redis.UniversalClient, m *redisfront.Metrics) storetest.Harness {
	var pools sync.Map // idem.Store → *pgxpool.Pool
	newAt := func(t *testing.T, now func() time.Time) idem.Store {
		pool := testSchema(t, 4, nil)
		if _, err := pool.Exec(context.Background(), `CREATE TABLE storetest_effects (name text NOT NULL)`); err != nil {
			t.Fatalf("creating storetest_effects: %v", err)
		}
		s := redisfront.New(rdb, pgstore.New(pool, pgstore.Options{Now: now}), redisfront.Options{
			Timeout:   suiteTimeout,
			KeyPrefix: uniquePrefix(t, rdb),
			Metrics:   m,
			Now:       now,
		})
		pools.Store(s, pool)
		t.Cleanup(func() { pools.Delete(s) })
		return s
	}
	return storetest.Harness{
		New:   func(t *testing.T) idem.Store { return newAt(t, nil) },
		NewAt: newAt,
		Write: func(ctx context.Context, tx idem.Tx, name string) error {
			ptx, ok := unwrapTx(tx).(*pgstore.Tx)
			if !ok {
				return fmt.Errorf("transaction %T is not a pgstore one", tx)
			}
			_, err := ptx.PgxTx().Exec(ctx, `INSERT INTO storetest_effects (name) VALUES ($1)`, name)
			return err
		},
		HandlerCommit: func(ctx context.Context) error {
			tx, err := pgstore.FromContext(ctx)
			if err != nil {
				return err
			}
			return tx.Commit(ctx)
		},
		HandlerRollback: func(ctx context.Context) error {
			tx, err := pgstore.FromContext(ctx)
			if err != nil {
				return err
			}
			return tx.Rollback(ctx)
		},
		Count: func(ctx context.Context, s idem.Store, name string) (int, error) {
			pool, ok := pools.Load(s)
			if !ok {
				return 0, errors.New("unknown store")
			}
			var n int
			err := pool.(*pgxpool.Pool).QueryRow(ctx, `SELECT count(*) FROM storetest_effects WHERE name = $1`, name).Scan(&n)
			return n, err
		},
	}
}

// requireBinaries skips t when the Redis binaries are missing, except
// under CI=true, where it fails.
func requireBinaries(t testing.TB, names ...string) {
	t.Helper()
	for _, n := range names {
		if _, err := exec.LookPath(n); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s not on PATH: %v", n, err)
			}
			t.Skipf("redisfront: %s not on PATH", n)
		}
	}
}

// freePort returns a loopback port nobody listens on; with bus, the port
// 10000 above it (a cluster node's bus) is free too.
func freePort(t testing.TB, bus bool) int {
	t.Helper()
	for range 100 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		if !bus {
			ln.Close()
			return port
		}
		if port+10000 > 65535 {
			ln.Close()
			continue
		}
		ln2, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+10000))
		ln.Close()
		if err != nil {
			continue
		}
		ln2.Close()
		return port
	}
	t.Fatal("no free port")
	return 0
}

// redisServer is a redis-server the test started.
type redisServer struct {
	addr string
	cmd  *exec.Cmd
	out  *syncBuffer
}

// startRedis starts a redis-server on a free loopback port, without
// persistence, killed when t ends. extra are further arguments.
func startRedis(t testing.TB, bus bool, extra ...string) *redisServer {
	t.Helper()
	requireBinaries(t, "redis-server")
	var last error
	for range 5 {
		port := freePort(t, bus)
		dir := t.TempDir()
		args := append([]string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
			"--save", "", "--appendonly", "no", "--dir", dir, "--daemonize", "no"}, extra...)
		if bus {
			args = append(args, "--cluster-enabled", "yes", "--cluster-config-file", dir+"/nodes-"+strconv.Itoa(port)+".conf")
		}
		out := new(syncBuffer)
		cmd := exec.Command("redis-server", args...)
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Start(); err != nil {
			t.Fatalf("starting redis-server: %v", err)
		}
		srv := &redisServer{addr: "127.0.0.1:" + strconv.Itoa(port), cmd: cmd, out: out}
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }() // reaps it; killed in cleanup
		t.Cleanup(func() {
			cmd.Process.Kill()
			<-exited
		})
		if last = waitPing(srv.addr, exited, 10*time.Second); last == nil {
			return srv
		}
		cmd.Process.Kill()
		t.Logf("redis-server on %s did not start (%v): %s", srv.addr, last, out.String())
	}
	t.Fatalf("redis-server did not start: %v", last)
	return nil
}

func waitPing(addr string, exited <-chan struct{}, d time.Duration) error {
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(d)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			return errors.New("redis-server exited")
		default:
		}
		if time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond) // a poll with a deadline: ends as soon as the server answers
	}
}

// startCluster starts a three-node Redis Cluster (no replicas) and returns
// a cluster client of it.
func startCluster(t testing.TB) *redis.ClusterClient {
	t.Helper()
	requireBinaries(t, "redis-server", "redis-cli")
	var addrs []string
	for range 3 {
		addrs = append(addrs, startRedis(t, true).addr)
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command("redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	deadline := time.Now().Add(30 * time.Second)
	for _, a := range addrs {
		c := redis.NewClient(&redis.Options{Addr: a})
		for {
			info, err := c.ClusterInfo(context.Background()).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") {
				break
			}
			if time.Now().After(deadline) {
				c.Close()
				t.Fatalf("cluster node %s not ok: %v\n%s", a, err, info)
			}
			time.Sleep(50 * time.Millisecond) // a poll with a deadline: ends as soon as the node is ok
		}
		c.Close()
	}
	rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: addrs}).(*redis.ClusterClient)
	t.Cleanup(func() { rdb.Close() })
	// Every node must know the whole slot map before the tests begin.
	for {
		err := rdb.ForEachShard(context.Background(), func(ctx context.Context, c *redis.Client) error {
			return c.Ping(ctx).Err()
		})
		if err == nil {
			if err = checkSlots(rdb); err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("cluster client: %v", err)
		}
		rdb.ReloadState(context.Background())
		time.Sleep(50 * time.Millisecond) // a poll with a deadline: ends as soon as every node knows the slots
	}
	return rdb
}

// checkSlots writes a key to every master through rdb.
func checkSlots(rdb *redis.ClusterClient) error {
	ctx := context.Background()
	for i := range 30 {
		k := fmt.Sprintf("idemtest:probe:{%d}", i)
		if err := rdb.Set(ctx, k, "1", time.Second).Err(); err != nil {
			return err
		}
	}
	return nil
}

// syncBuffer is a bytes.Buffer safe for a process's output and a reader.
type syncBuffer struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
