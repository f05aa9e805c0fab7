// Package redistest gives the project's tests their Redis, as
// internal/pgtest gives them PostgreSQL: the server named by
// TEST_REDIS_URL or, under CI=true without it, the machine's
// (DefaultURL); elsewhere without it a test that needs Redis is skipped,
// saying why. Tests share one server, each under a key prefix of its own
// (Prefix).
package redistest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// DefaultURL is the machine's Redis, used under CI=true when
// TEST_REDIS_URL is unset.
const DefaultURL = "redis://127.0.0.1:6379"

// URL returns the Redis the tests use: TEST_REDIS_URL, else under
// CI=true DefaultURL; else t is skipped, with a message naming who (the
// package whose tests need it).
func URL(t testing.TB, who string) string {
	t.Helper()
	if u := os.Getenv("TEST_REDIS_URL"); u != "" {
		return u
	}
	if os.Getenv("CI") == "true" {
		return DefaultURL
	}
	t.Skip(who + ": Redis tests skipped: set TEST_REDIS_URL (for example " + DefaultURL + ") or CI=true")
	return ""
}

// Client returns a client of URL's Redis that honours context
// deadlines (ContextTimeoutEnabled), with each of edit applied to its
// options, closed when t ends. t fails if that Redis does not answer.
func Client(t testing.TB, who string, edit ...func(*redis.Options)) *redis.Client {
	t.Helper()
	u := URL(t, who)
	opt, err := redis.ParseURL(u)
	if err != nil {
		t.Fatalf("TEST_REDIS_URL %q: %v", u, err)
	}
	opt.ContextTimeoutEnabled = true
	for _, f := range edit {
		f(opt)
	}
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { rdb.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Fatalf("Redis at %s does not answer: %v", u, err)
	}
	return rdb
}

// Prefix returns a key prefix of t's own, name, a colon, 12 random hex
// digits and a colon, so that tests may share one Redis; the keys under
// it are deleted when t ends (on every master of a cluster client).
func Prefix(t testing.TB, rdb redis.UniversalClient, name string) string {
	t.Helper()
	var b [6]byte
	rand.Read(b[:])
	prefix := name + ":" + hex.EncodeToString(b[:]) + ":"
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := Delete(ctx, rdb, prefix); err != nil {
			t.Logf("deleting keys %s*: %v", prefix, err)
		}
	})
	return prefix
}

// Delete deletes every key under prefix (SCAN, then DEL; on every
// master of a cluster client) and returns how many it deleted.
func Delete(ctx context.Context, rdb redis.UniversalClient, prefix string) (int, error) {
	var n atomic.Int64 // ForEachMaster calls del concurrently
	del := func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			if err := c.Del(ctx, iter.Val()).Err(); err != nil {
				return err
			}
			n.Add(1)
		}
		return iter.Err()
	}
	var err error
	switch c := rdb.(type) {
	case *redis.Client:
		err = del(ctx, c)
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, del)
	default:
		err = fmt.Errorf("redistest: cannot scan a %T", rdb)
	}
	return int(n.Load()), err
}
