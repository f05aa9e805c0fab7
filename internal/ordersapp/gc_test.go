package ordersapp

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idem-go/idem"
)

// TestMigrateAndGC: migrate makes the schema; gc deletes the expired keys
// and leaves the live ones, and reports how many it deleted.
func TestMigrateAndGC(t *testing.T) {
	dir := t.TempDir()
	if code, out, errs := run(t, nil, "migrate", "--data-dir", dir); code != 0 || !strings.Contains(out, "schema up to date") {
		t.Fatalf("migrate: exit %d %q %q", code, out, errs)
	}
	ctx := context.Background()
	c := Config{DataDir: dir}
	be, err := openBackend(ctx, &c)
	if err != nil {
		t.Fatal(err)
	}
	claim := func(key string, ttl time.Duration) {
		t.Helper()
		if _, err := be.store.Claim(ctx, idem.ClaimParams{User: "u", Key: key, Fingerprint: "f", Method: "POST", Path: "/v1/orders", TTL: ttl, Lease: time.Millisecond}); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 25; i++ {
		claim(fmt.Sprintf("old-%d", i), time.Millisecond)
	}
	claim("live", time.Hour)
	be.close()
	time.Sleep(10 * time.Millisecond)

	code, out, errs := run(t, nil, "gc", "--data-dir", dir, "--batch", "10")
	if code != 0 || !strings.Contains(out, "deleted 25 expired keys") {
		t.Fatalf("gc: exit %d %q %q", code, out, errs)
	}
	be, err = openBackend(ctx, &c)
	if err != nil {
		t.Fatal(err)
	}
	defer be.close()
	if _, err := be.store.Get(ctx, "u", "live"); err != nil {
		t.Errorf("live key: %v", err)
	}
}

func TestRedisURLForms(t *testing.T) {
	one, err := newRedis("redis://127.0.0.1:6379/0")
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	if _, ok := one.(*redis.Client); !ok {
		t.Errorf("one server: got %T, want *redis.Client", one)
	}
	cluster, err := newRedis("redis://127.0.0.1:7000?addr=127.0.0.1:7001&addr=127.0.0.1:7002")
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	cc, ok := cluster.(*redis.ClusterClient)
	if !ok {
		t.Fatalf("cluster form: got %T, want *redis.ClusterClient", cluster)
	}
	if got := len(cc.Options().Addrs); got != 3 {
		t.Errorf("cluster addresses = %d, want 3", got)
	}
	for _, bad := range []string{"http://x", "redis://host:notaport", "::"} {
		if code, _, errs := run(t, nil, "serve", "--redis-url", bad, "--data-dir", t.TempDir()); code != 2 {
			t.Errorf("--redis-url %q: exit %d (%s), want 2", bad, code, errs)
		}
	}
}
