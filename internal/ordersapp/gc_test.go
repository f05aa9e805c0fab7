package ordersapp

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

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
