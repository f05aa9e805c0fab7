package redisfront

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/storetest"
)

// TestPurgeDropsTheLeaseLock: a key whose attempt's lease ran out (by the
// inner store's clock) while Redis still holds that attempt's lease lock
// is purged: the lock goes with the record, so that the client's retry
// starts the new operation at once instead of being told 409 by a lock of
// a record that no longer exists; and a lock for the purged attempt that
// arrives late is refused.
func TestPurgeDropsTheLeaseLock(t *testing.T) {
	base, _, rdb := testStore(t, Options{})
	clk := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	// No test clock here: Redis honours a lease lock until it expires
	// (LockTTL), as in production.
	s := New(rdb, memstore.New(memstore.Options{Now: clk.Now}), Options{KeyPrefix: base.opts.KeyPrefix, Timeout: time.Second, LockTTL: time.Minute})
	ctx := context.Background()
	p := params("k-purged", "fp")
	old := lease(t, s, p)
	k := s.keysFor(p.User, p.Key)
	if v, _ := rdb.Get(ctx, k.lock).Result(); !strings.HasPrefix(v, leasePrefix(old.Owner)) {
		t.Fatalf("lock = %q, want the attempt's lease lock", v)
	}
	clk.Advance(time.Minute) // the lease ran out by the inner store's clock
	info, err := s.InspectKey(ctx, p.User, p.Key, 0)
	if err != nil || info.State != idemdriver.KeyAbandoned {
		t.Fatalf("InspectKey = %+v, %v; want abandoned", info, err)
	}
	if _, err := s.Purge(ctx, p.User, p.Key, idemdriver.SeenOf(&info.Record)); err != nil {
		t.Fatalf("Purge: %v", err)
	}
	if v, err := rdb.Get(ctx, k.lock).Result(); err == nil && strings.HasPrefix(v, leasePrefix(old.Owner)) {
		t.Errorf("the purged attempt's lease lock is still in Redis: %q", v)
	}
	if s.setLock(ctx, k, old.Owner, old.Until, p.Fingerprint, time.Minute) {
		t.Errorf("a late lease lock for the purged attempt was written")
	}
	c, err := s.Claim(ctx, p)
	if err != nil || c.Lease == nil || c.Lease.Attempt != 1 || c.Lease.CreatedAt.Equal(old.CreatedAt) {
		t.Fatalf("retry after Purge = %+v, %v; want the lease of a new operation", c, err)
	}
	if n := s.Metrics().InFlightFromRedis.Load(); n != 0 {
		t.Errorf("Redis answered %d claims in flight, want 0", n)
	}
}

// TestPurgeRefusedKeepsOtherLocks: a purge refused because another
// attempt took the key over leaves that attempt's lease lock in Redis:
// only the lock of the attempt seen is dropped.
func TestPurgeRefusedKeepsOtherLocks(t *testing.T) {
	base, _, rdb := testStore(t, Options{})
	clk := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	s := New(rdb, memstore.New(memstore.Options{Now: clk.Now}), Options{KeyPrefix: base.opts.KeyPrefix, Timeout: time.Second, LockTTL: time.Minute})
	ctx := context.Background()
	p := params("k-retried", "fp")
	lease(t, s, p)
	clk.Advance(time.Minute)
	info, err := s.InspectKey(ctx, p.User, p.Key, 0)
	if err != nil {
		t.Fatal(err)
	}
	k := s.keysFor(p.User, p.Key)
	rdb.Del(ctx, k.lock)    // as once LockTTL passed
	retry := lease(t, s, p) // a client's retry takes the key over
	if _, err := s.Purge(ctx, p.User, p.Key, idemdriver.SeenOf(&info.Record)); !errors.Is(err, idemdriver.ErrNotPurgeable) {
		t.Fatalf("Purge after the takeover: %v, want ErrNotPurgeable", err)
	}
	if v, _ := rdb.Get(ctx, k.lock).Result(); !strings.HasPrefix(v, leasePrefix(retry.Owner)) {
		t.Errorf("lock = %q, want the retry's lease lock", v)
	}
	if _, err := s.Claim(ctx, p); !errors.Is(err, idem.ErrInFlight) || s.Metrics().InFlightFromRedis.Load() != 1 {
		t.Errorf("duplicate of the retry: %v; want ErrInFlight from Redis", err)
	}
	complete(t, s, retry, "done")
}
