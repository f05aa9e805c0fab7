package redisfront_test

import (
	"net"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/redistest"
	"github.com/idem-go/idem/redisfront"
	"github.com/idem-go/idem/storetest"
	"github.com/redis/go-redis/v9"
)

// checkServed fails t, once its subtests are done, unless Redis answered
// some claims itself: a suite that passed with Redis ignored proves
// nothing about the fast path.
func checkServed(t *testing.T, m *redisfront.Metrics) {
	t.Cleanup(func() {
		t.Logf("redis: %d replays, %d in flight, %d mismatches, %d inner claims, %d fills, %d locks, %d waits, %d errors",
			m.ReplaysFromRedis.Load(), m.InFlightFromRedis.Load(), m.MismatchesFromRedis.Load(),
			m.InnerClaims.Load(), m.CacheFills.Load(), m.LocksSet.Load(), m.ClaimWaits.Load(), m.RedisErrors.Load())
		if m.ReplaysFromRedis.Load() == 0 || m.InFlightFromRedis.Load() == 0 || m.MismatchesFromRedis.Load() == 0 {
			t.Errorf("Redis answered no replay, in-flight or mismatch: the fast path was not exercised")
		}
		if n := m.RedisErrors.Load(); n != 0 {
			t.Errorf("RedisErrors = %d, want 0", n)
		}
	})
}

// TestConformanceMemstore runs the store suite on redisfront in front of
// memstore, with the tests' Redis.
func TestConformanceMemstore(t *testing.T) {
	rdb := newRedis(t)
	m := new(redisfront.Metrics)
	checkServed(t, m)
	storetest.Run(t, memHarness(rdb, m))
}

// TestConformancePostgres runs the store suite on redisfront in front of
// pgstore, each store on a schema of its own, with the tests' Redis.
func TestConformancePostgres(t *testing.T) {
	rdb := newRedis(t)
	m := new(redisfront.Metrics)
	checkServed(t, m)
	storetest.Run(t, pgHarness(rdb, m))
}

// TestConformanceCluster runs the store suite against a three-node Redis
// Cluster that the test starts, in front of memstore and pgstore.
func TestConformanceCluster(t *testing.T) {
	redistest.URL(t, "redisfront") // the same skip rule as the other Redis tests
	rdb := startCluster(t)
	for _, tc := range []struct {
		name    string
		harness func(redis.UniversalClient, *redisfront.Metrics) storetest.Harness
	}{
		{"memstore", memHarness},
		{"postgres", pgHarness},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := new(redisfront.Metrics)
			checkServed(t, m)
			storetest.Run(t, tc.harness(rdb, m))
		})
	}
}

// TestConformanceRedisDown runs the store suite in front of memstore with
// a Redis that refuses connections, and with one that accepts them and
// never answers: every Redis call fails, and the inner store decides
// alone. It needs no Redis.
func TestConformanceRedisDown(t *testing.T) {
	for _, tc := range []struct {
		name string
		addr func(t *testing.T) string
		opts redis.Options
	}{
		{"refused", closedPort, redis.Options{ContextTimeoutEnabled: true}},
		{"silent", silentServer, redis.Options{}}, // calls on goroutines of their own
	} {
		t.Run(tc.name, func(t *testing.T) {
			opt := tc.opts
			opt.Addr, opt.MaxRetries = tc.addr(t), -1
			rdb := redis.NewClient(&opt)
			t.Cleanup(func() { rdb.Close() })
			m := new(redisfront.Metrics)
			t.Cleanup(func() {
				t.Logf("%d redis errors, %d inner claims", m.RedisErrors.Load(), m.InnerClaims.Load())
				if m.RedisErrors.Load() == 0 {
					t.Errorf("no Redis error counted")
				}
				if n := m.ReplaysFromRedis.Load() + m.InFlightFromRedis.Load() + m.MismatchesFromRedis.Load(); n != 0 {
					t.Errorf("%d answers from a Redis that is down", n)
				}
			})
			noPrefix := func(testing.TB, redis.UniversalClient) string { return "idemtest:down:" }
			opts := redisfront.Options{Timeout: 10 * time.Millisecond, Logger: quietLogger()}
			storetest.Run(t, memHarnessWith(rdb, m, opts, noPrefix))
		})
	}
}

// closedPort returns a loopback address nobody listens on.
func closedPort(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// silentServer returns the address of a server that accepts connections,
// reads what it is sent and never answers.
func silentServer(t *testing.T) string {
	return serveLoopback(t, func(c net.Conn, _ func(net.Conn)) {
		b := make([]byte, 4096)
		for {
			if _, err := c.Read(b); err != nil {
				return
			}
		}
	})
}

// serveLoopback listens on a free loopback port, runs handle on its own
// goroutine for every connection it accepts, and returns the address.
// When t ends it closes the listener, every accepted connection and every
// other connection handle passed to track.
func serveLoopback(t testing.TB, handle func(c net.Conn, track func(net.Conn))) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex // guards conns
		conns []net.Conn
	)
	track := func(c net.Conn) {
		mu.Lock()
		defer mu.Unlock()
		conns = append(conns, c)
	}
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			track(c)
			go handle(c, track)
		}
	}()
	return ln.Addr().String()
}
