package ordersapp

import (
	"context"
	"fmt"
	"net/url"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/redisfront"
)

// newRedis returns a client for REDIS_URL: redis://host:port for one
// server, or go-redis's cluster form redis://h1:p1?addr=h2:p2&addr=h3:p3
// for a Redis Cluster.
func newRedis(raw string) (redis.UniversalClient, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "redis" && u.Scheme != "rediss") {
		return nil, cli.Usagef("--redis-url: want redis://host:port or redis://h1:p1?addr=h2:p2&addr=h3:p3")
	}
	if u.Query().Has("addr") {
		opts, err := redis.ParseClusterURL(raw)
		if err != nil {
			return nil, cli.Usagef("--redis-url: %v", err)
		}
		opts.ContextTimeoutEnabled = true // the fast path's per-call deadline must hold
		return redis.NewClusterClient(opts), nil
	}
	opts, err := redis.ParseURL(raw)
	if err != nil {
		return nil, cli.Usagef("--redis-url: %v", err)
	}
	opts.ContextTimeoutEnabled = true
	return redis.NewClient(opts), nil
}

// withRedis puts the Redis fast path in front of be's store. Redis is only
// an accelerator: when it is down at start the service still starts (the
// caller logs a warning), and every request goes on against the database
// alone until it is back. Its keys begin with "idem:" and the database's
// deployment id, so that deployments on two databases that share one Redis
// never read each other's entries.
func withRedis(ctx context.Context, be *backend, raw string) (*redisfront.Store, redis.UniversalClient, error) {
	rdb, err := newRedis(raw)
	if err != nil {
		return nil, nil, err
	}
	id, err := be.deployment(ctx)
	if err != nil {
		rdb.Close()
		return nil, nil, fmt.Errorf("reading the deployment id: %w", err)
	}
	fs := redisfront.New(rdb, be.store, redisfront.Options{KeyPrefix: redisfront.DefaultKeyPrefix + id + ":"})
	be.store = fs
	be.sweeper = fs
	be.name += "+redis"
	be.closers = append(be.closers, func() { rdb.Close() })
	return fs, rdb, nil
}

// redisCollector is a prometheus.Collector of the fast path's counters.
type redisCollector struct{ m *redisfront.Metrics }

// redisCounters are the fast path's counters, by metric name.
var redisCounters = []struct {
	desc *prometheus.Desc
	v    func(m *redisfront.Metrics) *atomic.Int64
}{
	{prometheus.NewDesc("idem_redis_errors_total", "Redis calls that failed or timed out; the request went on against the database alone.", nil, nil), func(m *redisfront.Metrics) *atomic.Int64 { return &m.RedisErrors }},
	{prometheus.NewDesc("idem_redis_replays_total", "Claims answered with a response cached in Redis.", nil, nil), func(m *redisfront.Metrics) *atomic.Int64 { return &m.ReplaysFromRedis }},
	{prometheus.NewDesc("idem_redis_mismatches_total", "Claims answered 422 from a response cached in Redis.", nil, nil), func(m *redisfront.Metrics) *atomic.Int64 { return &m.MismatchesFromRedis }},
	{prometheus.NewDesc("idem_redis_in_flight_total", "Claims answered 409 from a lease lock in Redis.", nil, nil), func(m *redisfront.Metrics) *atomic.Int64 { return &m.InFlightFromRedis }},
	{prometheus.NewDesc("idem_redis_inner_claims_total", "Claims decided by the database.", nil, nil), func(m *redisfront.Metrics) *atomic.Int64 { return &m.InnerClaims }},
	{prometheus.NewDesc("idem_redis_claim_waits_total", "Claims that waited for another claim of the same key to be decided by the database.", nil, nil), func(m *redisfront.Metrics) *atomic.Int64 { return &m.ClaimWaits }},
	{prometheus.NewDesc("idem_redis_cache_fills_total", "Responses written to Redis.", nil, nil), func(m *redisfront.Metrics) *atomic.Int64 { return &m.CacheFills }},
	{prometheus.NewDesc("idem_redis_locks_set_total", "Lease locks written to Redis.", nil, nil), func(m *redisfront.Metrics) *atomic.Int64 { return &m.LocksSet }},
}

func (c redisCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, k := range redisCounters {
		ch <- k.desc
	}
}

func (c redisCollector) Collect(ch chan<- prometheus.Metric) {
	for _, k := range redisCounters {
		ch <- prometheus.MustNewConstMetric(k.desc, prometheus.CounterValue, float64(k.v(c.m).Load()))
	}
}
