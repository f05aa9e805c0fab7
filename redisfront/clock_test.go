package redisfront

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

// errLost is a connection lost after the inner store committed a claim.
var errLost = errors.New("connection lost after the claim committed")

// lostAnswer is an inner store whose next Claim, once lose is set, commits
// and then reports errLost, as a claim whose answer was lost.
type lostAnswer struct {
	idem.Store
	lose atomic.Bool
}

func (s *lostAnswer) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	c, err := s.Store.Claim(ctx, p)
	if err == nil && s.lose.CompareAndSwap(true, false) {
		return idemdriver.Claim{}, errLost
	}
	return c, err
}

// sameLease fails t unless got is the lease want, as the store holds it.
func sameLease(t *testing.T, got, want *idemdriver.Lease) {
	t.Helper()
	if got.Owner != want.Owner || got.Attempt != want.Attempt || !got.Until.Equal(want.Until) ||
		!got.CreatedAt.Equal(want.CreatedAt) {
		t.Errorf("resent claim = %+v, want the lease %+v", got, want)
	}
}

// TestResentClaimGetsItsLease: a Claim sent again with the same Owner (its
// first answer was lost) gets its lease, though Redis holds that lease's
// lock, which answers ErrInFlight to every other attempt.
func TestResentClaimGetsItsLease(t *testing.T) {
	ctx := context.Background()

	t.Run("lock written by the first claim", func(t *testing.T) {
		s, ms, rdb := testStore(t, Options{})
		p := params("k", "fp")
		p.Owner = idemdriver.NewOwner()
		first := lease(t, s, p)
		k := s.keysFor(p.User, p.Key)
		if v, _ := rdb.Get(ctx, k.lock).Result(); !strings.HasPrefix(v, leasePrefix(p.Owner)) {
			t.Fatalf("lock %q, want the lease lock of %s", v, p.Owner)
		}
		for i := range 3 {
			c, err := s.Claim(ctx, p)
			if err != nil || c.Lease == nil {
				t.Fatalf("resent claim %d = %+v, %v; want its lease", i, c, err)
			}
			sameLease(t, c.Lease, first)
		}
		// Every other attempt is still answered by Redis.
		other := p
		other.Owner = idemdriver.NewOwner()
		before := s.Metrics().InFlightFromRedis.Load()
		if _, err := s.Claim(ctx, other); !errors.Is(err, idem.ErrInFlight) || s.Metrics().InFlightFromRedis.Load() != before+1 {
			t.Errorf("another attempt: %v; want ErrInFlight from Redis", err)
		}
		complete(t, s, first, "done")
		if c, err := s.Claim(ctx, other); err != nil || c.Response == nil || string(c.Response.Body) != "done" {
			t.Errorf("after completion: %+v, %v; want the replay", c, err)
		}
		if rec, err := ms.Get(ctx, p.User, p.Key); err != nil || rec.Attempts != 1 {
			t.Errorf("record = %+v, %v; want 1 attempt", rec, err)
		}
	})

	t.Run("first answer lost, lock written by a duplicate", func(t *testing.T) {
		fast, ms, rdb := testStore(t, Options{})
		inner := &lostAnswer{Store: ms}
		s := New(rdb, inner, fast.opts)
		p := params("k", "fp")
		p.Owner = idemdriver.NewOwner()
		inner.lose.Store(true)
		if _, err := s.Claim(ctx, p); !errors.Is(err, errLost) {
			t.Fatalf("first claim: %v, want its answer lost", err)
		}
		// A duplicate learns from the inner store that p.Owner holds the
		// key, and writes its lease lock.
		dup := p
		dup.Owner = idemdriver.NewOwner()
		if _, err := s.Claim(ctx, dup); !errors.Is(err, idem.ErrInFlight) {
			t.Fatalf("duplicate: %v, want ErrInFlight", err)
		}
		k := s.keysFor(p.User, p.Key)
		if v, _ := rdb.Get(ctx, k.lock).Result(); !strings.HasPrefix(v, leasePrefix(p.Owner)) {
			t.Fatalf("lock %q, want the lease lock of %s", v, p.Owner)
		}
		c, err := s.Claim(ctx, p)
		if err != nil || c.Lease == nil {
			t.Fatalf("resent claim = %+v, %v; want its lease", c, err)
		}
		rec, err := ms.Get(ctx, p.User, p.Key)
		if err != nil || rec.Owner != p.Owner || rec.Attempts != 1 || c.Lease.Owner != p.Owner || c.Lease.Attempt != 1 {
			t.Fatalf("lease %+v, record %+v, %v; want one attempt, by %s", c.Lease, rec, err, p.Owner)
		}
		before := s.Metrics().InFlightFromRedis.Load()
		if _, err := s.Claim(ctx, dup); !errors.Is(err, idem.ErrInFlight) || s.Metrics().InFlightFromRedis.Load() != before+1 {
			t.Errorf("duplicate after the resend: %v; want ErrInFlight from Redis", err)
		}
		complete(t, s, c.Lease, "done")
		if c, err := s.Claim(ctx, dup); err != nil || c.Response == nil || string(c.Response.Body) != "done" {
			t.Errorf("after completion: %+v, %v; want the replay", c, err)
		}
	})

	t.Run("concurrent resends", func(t *testing.T) {
		// A slow inner store: the resends arrive while the first claim
		// is being decided, and after its lease lock is written.
		fast, ms, rdb := testStore(t, Options{})
		s := New(rdb, slowClaims{ms, 20 * time.Millisecond}, fast.opts)
		p := params("k", "fp")
		p.Owner = idemdriver.NewOwner()
		var (
			wg     sync.WaitGroup
			failed atomic.Int64
		)
		leases := make(chan *idemdriver.Lease, 40)
		for i := range 40 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(time.Duration(i) * time.Millisecond) // not waiting for an outcome: spreads the claims' arrivals, by design
				c, err := s.Claim(ctx, p)
				if err != nil || c.Lease == nil {
					if failed.Add(1) == 1 {
						t.Errorf("claim = %+v, %v; want the lease of %s", c, err, p.Owner)
					}
					return
				}
				leases <- c.Lease
			}()
		}
		wg.Wait()
		close(leases)
		if n := failed.Load(); n > 0 {
			t.Errorf("%d of 40 resends were not given their lease", n)
		}
		rec, err := ms.Get(ctx, p.User, p.Key)
		if err != nil || rec.Owner != p.Owner || rec.Attempts != 1 {
			t.Fatalf("record = %+v, %v; want one attempt by %s", rec, err, p.Owner)
		}
		for l := range leases {
			if l.Owner != p.Owner || l.Attempt != 1 || !l.Until.Equal(rec.LeaseUntil) {
				t.Errorf("lease %+v, want the record's (%s, attempt 1, until %v)", l, p.Owner, rec.LeaseUntil)
			}
		}
	})
}

// TestCacheNeverOutlivesRecord: a cached response's PX never exceeds the
// life its record has left as the inner store reports it, whether the
// response was cached at completion, after a replay from the inner store,
// or after a takeover of a record whose expiry passed (which the store
// extends at completion); whatever the store's clock and the process's
// (Options.Now, a test clock, hours away). And the entry is cached when
// its life is known.
func TestCacheNeverOutlivesRecord(t *testing.T) {
	ctx := context.Background()
	// The inner store's clock (the database's) is hours ahead of the
	// machine's.
	storeNow := func() time.Time { return time.Now().Add(5 * time.Hour) }
	for _, tc := range []struct {
		name string
		now  func() time.Time
	}{
		{"no test clock", nil},
		{"process clock 3h behind", func() time.Time { return time.Now().Add(-3 * time.Hour) }},
		{"process clock 3h ahead", func() time.Time { return time.Now().Add(3 * time.Hour) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fast, _, rdb := testStore(t, Options{Now: tc.now})
			ms := memstore.New(memstore.Options{Now: storeNow})
			s := New(rdb, ms, fast.opts)

			// check fails t unless the entry of p, if any, lives no
			// longer than its record, and reports whether there is one.
			check := func(p idemdriver.ClaimParams) bool {
				t.Helper()
				pttl, err := rdb.PTTL(ctx, s.keysFor(p.User, p.Key).resp).Result()
				if err != nil {
					t.Fatalf("PTTL: %v", err)
				}
				// Read after PTTL: the record's life is only shorter then.
				c, err := ms.Claim(ctx, p)
				if err != nil || c.Response == nil {
					t.Fatalf("inner claim = %+v, %v; want the response", c, err)
				}
				if pttl == -1 || pttl > c.ExpiresIn {
					t.Errorf("entry PX %v, record's life %v: the entry outlives its record", pttl, c.ExpiresIn)
				}
				t.Logf("entry PX %v, record's life %v", pttl, c.ExpiresIn)
				return pttl > 0
			}

			p := params("completed", "fp")
			p.TTL = 4 * time.Second
			l := lease(t, s, p)
			time.Sleep(time.Second) // not waiting for an outcome: the attempt runs while Redis's clock (which cannot be faked) moves
			complete(t, s, l, "done")
			if !check(p) {
				t.Errorf("completed: nothing cached")
			}

			// The entry is gone (flushed): a replay from the inner store
			// caches it again.
			rdb.Del(ctx, s.keysFor(p.User, p.Key).resp)
			if c, err := s.Claim(ctx, p); err != nil || c.Response == nil {
				t.Fatalf("replay = %+v, %v", c, err)
			}
			if !check(p) {
				t.Errorf("replayed by the inner store: nothing cached")
			}
			before := s.Metrics().ReplaysFromRedis.Load()
			if c, err := s.Claim(ctx, p); err != nil || c.Response == nil || s.Metrics().ReplaysFromRedis.Load() != before+1 {
				t.Errorf("replay = %+v, %v; want it from Redis", c, err)
			}

			// An attempt outlives the record's expiry; another takes its
			// key over and completes: the store keeps the record a TTL
			// from then.
			p = params("taken over", "fp")
			p.TTL, p.Lease = 1500*time.Millisecond, 500*time.Millisecond
			first := lease(t, s, p)
			time.Sleep(1600 * time.Millisecond) // not waiting for an outcome: Redis's clock (which cannot be faked) passes the lease and the TTL
			p.Owner = idemdriver.NewOwner()
			second := lease(t, s, p)
			if second.Attempt != 2 || !second.CreatedAt.Equal(first.CreatedAt) {
				t.Fatalf("takeover = %+v, want attempt 2 of %+v", second, first)
			}
			complete(t, s, second, "late")
			check(p)
		})
	}
}
