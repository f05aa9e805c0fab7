package storetest

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

func testLeaseTakeover(t *testing.T, h Harness) {
	s, advance := aging(t, h)
	p := params("u1", "k-takeover", "fp1")
	p.Lease = 150 * time.Millisecond
	first := mustLease(t, s, p)
	if _, err := s.Claim(context.Background(), p); !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("claim within lease: got %v, want ErrInFlight", err)
	}
	advance(250 * time.Millisecond)
	second := mustLease(t, s, p)
	if second.Owner == first.Owner {
		t.Errorf("takeover kept owner %q", first.Owner)
	}
	if second.Attempt != 2 {
		t.Errorf("takeover Attempt = %d, want 2", second.Attempt)
	}
	// Values derived from CreatedAt (a downstream key) must agree exactly.
	if first.CreatedAt.IsZero() || !second.CreatedAt.Equal(first.CreatedAt) {
		t.Errorf("takeover CreatedAt = %v, first lease's %v; want equal and set", second.CreatedAt, first.CreatedAt)
	}
	rec, err := s.Get(context.Background(), p.User, p.Key)
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if !rec.CreatedAt.Equal(first.CreatedAt) {
		t.Errorf("record CreatedAt = %v, lease's %v; want equal", rec.CreatedAt, first.CreatedAt)
	}
}

func testFenced(t *testing.T, h Harness) {
	ctx := context.Background()
	s, advance := aging(t, h)
	p := params("u1", "k-fenced", "fp1")
	p.Lease = 150 * time.Millisecond
	slow := mustLease(t, s, p)
	advance(250 * time.Millisecond)
	p.Lease = 10 * time.Second
	fast := mustLease(t, s, p)

	if err := run(ctx, h, s, slow, "fenced-slow", response("slow")); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("slow attempt Complete: got %v, want ErrFenced", err)
	}
	if err := run(ctx, h, s, slow, "fenced-slow", nil); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("slow attempt Complete(nil): got %v, want ErrFenced", err)
	}
	if err := s.Release(ctx, slow); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("slow attempt Release: got %v, want ErrFenced", err)
	}
	if err := s.Fail(ctx, slow); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("slow attempt Fail: got %v, want ErrFenced", err)
	}
	want := response("fast")
	if err := run(ctx, h, s, fast, "fenced-fast", want); err != nil {
		t.Fatalf("fast attempt: %v", err)
	}
	if got := count(t, h, s, "fenced-slow"); got != 0 {
		t.Errorf("fenced attempt's effects = %d, want 0", got)
	}
	if got := count(t, h, s, "fenced-fast"); got != 1 {
		t.Errorf("owner's effects = %d, want 1", got)
	}
	c, err := s.Claim(ctx, p)
	if err != nil {
		t.Fatalf("replay: %v", err)
	}
	sameResponse(t, c.Response, want)
}

// testConcurrentTakeover has many attempts race for keys whose lease ran
// out: for one key exactly one of them takes over; for the other the
// first holder tries to commit meanwhile, and exactly one side wins.
func testConcurrentTakeover(t *testing.T, h Harness) {
	ctx := context.Background()
	s, advance := aging(t, h)
	p := params("u1", "k-takeover-race", "fp1")
	q := params("u1", "k-takeover-commit", "fp1")
	p.Lease, q.Lease = 50*time.Millisecond, 50*time.Millisecond
	mustLease(t, s, p)
	first := mustLease(t, s, q)
	advance(100 * time.Millisecond)
	p.Lease, q.Lease = 10*time.Second, 10*time.Second

	// race has n attempts claim c at once while also runs, and counts the
	// leases and the in-flight answers they got.
	const n = 50
	race := func(c idemdriver.ClaimParams, also func()) (leases, inFlight int64) {
		var nl, ni atomic.Int64
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				r, err := s.Claim(ctx, c)
				switch {
				case err == nil && r.Lease != nil:
					nl.Add(1)
					if r.Lease.Attempt != 2 {
						t.Errorf("%s: takeover Attempt = %d, want 2", c.Key, r.Lease.Attempt)
					}
				case errors.Is(err, idem.ErrInFlight):
					ni.Add(1)
				case err == nil && r.Response != nil:
				default:
					t.Errorf("%s: Claim: %+v, %v", c.Key, r, err)
				}
			}()
		}
		close(start)
		also()
		wg.Wait()
		return nl.Load(), ni.Load()
	}

	if leases, inFlight := race(p, func() {}); leases != 1 || inFlight != n-1 {
		t.Errorf("takeovers = %d, in flight = %d; want 1 and %d", leases, inFlight, n-1)
	}

	var err error
	leases, _ := race(q, func() { err = run(ctx, h, s, first, "takeover-first", response("first")) })
	switch {
	case err == nil:
		if leases != 0 {
			t.Errorf("the first holder committed, yet %d takeovers", leases)
		}
		if got := count(t, h, s, "takeover-first"); got != 1 {
			t.Errorf("committed effects = %d, want 1", got)
		}
	case errors.Is(err, idem.ErrFenced):
		if leases != 1 {
			t.Errorf("the first holder was fenced, takeovers = %d, want 1", leases)
		}
		if got := count(t, h, s, "takeover-first"); got != 0 {
			t.Errorf("fenced effects = %d, want 0", got)
		}
	default:
		t.Fatalf("first holder's Complete: %v", err)
	}
}

// testReplayAfterLease: a completed key replays long after its lease ran
// out, and its record keeps the time it completed.
func testReplayAfterLease(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	created := clk.Now()
	p := params("u1", "k-replay-late", "fp1")
	p.TTL = 24 * time.Hour
	l := mustLease(t, s, p)
	clk.Advance(time.Second)
	completed := clk.Now()
	want := response(`{"id":"1"}`)
	if err := run(ctx, h, s, l, "replay-late", want); err != nil {
		t.Fatalf("run: %v", err)
	}
	clk.Advance(time.Hour) // long after the lease: still a replay
	for i := range 3 {
		c, err := s.Claim(ctx, p)
		if err != nil {
			t.Fatalf("repeat %d: %v", i, err)
		}
		if c.Lease != nil {
			t.Fatalf("repeat %d: got a lease for a completed key", i)
		}
		sameResponse(t, c.Response, want)
	}
	if got := count(t, h, s, "replay-late"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
	rec, err := s.Get(ctx, p.User, p.Key)
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Response == nil || !rec.CompletedAt.Equal(completed) || !rec.CreatedAt.Equal(created) || !rec.ExpiresAt.Equal(created.Add(p.TTL)) {
		t.Errorf("Get = %+v, want completed at %v, created at %v, expiring %v", rec, completed, created, created.Add(p.TTL))
	}
}

// testLeaseBoundary: a lease is live until just before its Until and over
// at it; the takeover keeps the operation's CreatedAt.
func testLeaseBoundary(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	created := clk.Now()
	p := params("u1", "k-lease-boundary", "fp1")
	first := mustLease(t, s, p)
	clk.Advance(p.Lease - time.Nanosecond)
	_, err := s.Claim(ctx, p)
	var ife *idem.InFlightError
	if !errors.As(err, &ife) || !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("claim just before the lease ends: got %v, want *InFlightError", err)
	}
	if !ife.LeaseUntil.Equal(first.Until) {
		t.Errorf("LeaseUntil = %v, want %v", ife.LeaseUntil, first.Until)
	}

	clk.Advance(time.Nanosecond) // the lease ends at its Until
	second := mustLease(t, s, p)
	if second.Owner == first.Owner || second.Attempt != 2 || !second.CreatedAt.Equal(created) ||
		!second.Until.Equal(clk.Now().Add(p.Lease)) {
		t.Errorf("takeover = %+v, want a new owner, attempt 2, created %v, until %v", second, created, clk.Now().Add(p.Lease))
	}
	rec, err := s.Get(ctx, p.User, p.Key)
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Owner != second.Owner || rec.Attempts != 2 || !rec.LeaseUntil.Equal(second.Until) || !rec.CreatedAt.Equal(created) {
		t.Errorf("record = %+v, want the takeover's owner, attempts 2, lease until %v", rec, second.Until)
	}
	if _, err := s.Claim(ctx, p); !errors.Is(err, idem.ErrInFlight) {
		t.Errorf("claim after the takeover: got %v, want ErrInFlight", err)
	}
}

// testFailEndsLeaseNow: Fail ends the lease at the store's now, so the key
// is abandoned and the same request may take it over at once.
func testFailEndsLeaseNow(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	p := params("u1", "k-fail-now", "fp1")
	l := mustLease(t, s, p)
	clk.Advance(time.Second)
	if err := s.Fail(ctx, l); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	rec, err := s.Get(ctx, p.User, p.Key)
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if !rec.LeaseUntil.Equal(clk.Now()) || rec.Attempts != 1 {
		t.Errorf("after Fail: lease until %v attempts %d, want %v and 1", rec.LeaseUntil, rec.Attempts, clk.Now())
	}
	if sw, ok := s.(idemdriver.Sweeper); ok {
		if recs, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10}); err != nil || len(recs) != 1 || recs[0].Key != p.Key {
			t.Errorf("Abandoned after Fail = %s, %v; want %s", keys(recs), err, p.Key)
		}
	}
	l2 := mustLease(t, s, p) // at once, the clock unmoved
	if l2.Attempt != 2 || l2.Owner == l.Owner || !l2.Until.Equal(clk.Now().Add(p.Lease)) {
		t.Errorf("retry after Fail = %+v, want attempt 2, a new owner, until %v", l2, clk.Now().Add(p.Lease))
	}
}
