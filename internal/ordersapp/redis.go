package ordersapp

import (
	"context"
	"fmt"
	"io"
	"net/url"

	"github.com/redis/go-redis/v9"

	"github.com/idem-go/idem/internal/cli"
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

// writeRedisMetrics writes the fast path's counters in Prometheus text.
func writeRedisMetrics(w io.Writer, m *redisfront.Metrics) {
	for _, c := range []struct {
		name, help string
		v          int64
	}{
		{"idem_redis_errors_total", "Redis calls that failed or timed out; the request went on against the database alone.", m.RedisErrors.Load()},
		{"idem_redis_replays_total", "Claims answered with a response cached in Redis.", m.ReplaysFromRedis.Load()},
		{"idem_redis_mismatches_total", "Claims answered 422 from a response cached in Redis.", m.MismatchesFromRedis.Load()},
		{"idem_redis_in_flight_total", "Claims answered 409 from a lease lock in Redis.", m.InFlightFromRedis.Load()},
		{"idem_redis_inner_claims_total", "Claims decided by the database.", m.InnerClaims.Load()},
		{"idem_redis_cache_fills_total", "Responses written to Redis.", m.CacheFills.Load()},
	} {
		fmt.Fprintf(w, "# HELP %s %s\n# TYPE %s counter\n%s %d\n", c.name, c.help, c.name, c.name, c.v)
	}
}
