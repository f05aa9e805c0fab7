package storetest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

// purgeCases are the cases of idemdriver.Purger; they need Harness.NewAt, and
// skip for a store that is not an idemdriver.Purger and an idemdriver.Inspector.
var purgeCases = []struct {
	name string
	fn   func(*testing.T, Harness)
}{
	{"PurgeRefused", testPurgeRefused},
	{"PurgeDeletes", testPurgeDeletes},
	{"PurgeRacesLateComplete", testPurgeRacesLateComplete},
	{"PurgeRacesTakeover", testPurgeRacesTakeover},
}

// purger returns a fresh clocked store as an idemdriver.Purger and an
// idemdriver.Inspector, or skips.
func purger(t *testing.T, h Harness) (idem.Store, idemdriver.Purger, idemdriver.Inspector, *Clock) {
	t.Helper()
	s, in, clk := inspector(t, h)
	pu, ok := s.(idemdriver.Purger)
	if !ok {
		t.Skip("store does not implement idemdriver.Purger")
	}
	return s, pu, in, clk
}

// inspectSeen inspects (user, key) and returns what the operator saw.
func inspectSeen(t *testing.T, in idemdriver.Inspector, user, key string) (*idemdriver.KeyInfo, idemdriver.Seen) {
	t.Helper()
	info, err := in.InspectKey(context.Background(), user, key, 0)
	if err != nil {
		t.Fatalf("InspectKey(%s): %v", key, err)
	}
	return info, idemdriver.SeenOf(&info.Record)
}

// wantNotPurgeable checks that err is a *NotPurgeableError with state st
// and changed.
func wantNotPurgeable(t *testing.T, what string, err error, st idemdriver.KeyState, changed bool) {
	t.Helper()
	var np *idemdriver.NotPurgeableError
	if !errors.Is(err, idemdriver.ErrNotPurgeable) || !errors.As(err, &np) || np.State != st || np.Changed != changed {
		t.Errorf("Purge(%s) = %v; want a NotPurgeableError: %s, changed %v", what, err, st, changed)
	}
}

// testPurgeRefused: Purge refuses a key in flight, a completed one, and
// one that changed since it was inspected (taken over by a client's retry
// or a completer, or a new operation), reports a missing key (or an
// expired, completed one) as ErrNotFound, and changes nothing then.
func testPurgeRefused(t *testing.T, h Harness) {
	ctx := context.Background()
	s, pu, in, clk := purger(t, h)
	done := params("u1", "p-done", "fp1")
	if err := run(ctx, h, s, mustLease(t, s, done), "purge-p-done", response("done")); err != nil {
		t.Fatalf("run: %v", err)
	}
	expired := params("u1", "p-expired", "fp1")
	expired.TTL = time.Second
	expiredLease := mustLease(t, s, expired)
	if err := run(ctx, h, s, expiredLease, "purge-p-expired", response("expired")); err != nil {
		t.Fatalf("run: %v", err)
	}
	expiredSeen := idemdriver.Seen{Owner: expiredLease.Owner, Attempts: expiredLease.Attempt, CreatedAt: expiredLease.CreatedAt}
	long := params("u1", "p-flight", "fp1")
	long.Lease = time.Hour
	mustLease(t, s, long)
	// Abandoned keys, each inspected, then changed before the purge.
	for _, k := range []string{"p-retried", "p-redriven", "p-renewed", "p-finished"} {
		if err := s.Fail(ctx, mustLease(t, s, params("u1", k, "fp1"))); err != nil {
			t.Fatalf("Fail(%s): %v", k, err)
		}
	}
	clk.Advance(2 * time.Second)
	_, doneSeen := inspectSeen(t, in, "u1", "p-done")
	_, flightSeen := inspectSeen(t, in, "u1", "p-flight")
	retriedInfo, retriedSeen := inspectSeen(t, in, "u1", "p-retried")
	redrivenInfo, redrivenSeen := inspectSeen(t, in, "u1", "p-redriven")
	_, renewedSeen := inspectSeen(t, in, "u1", "p-renewed")
	_, finishedSeen := inspectSeen(t, in, "u1", "p-finished")
	if retriedInfo.State != idemdriver.KeyAbandoned {
		t.Fatalf("p-retried is %s, want abandoned", retriedInfo.State)
	}
	// Between the inspection and the purge: a client's retry takes
	// p-retried over; a completer re-drives p-redriven; p-renewed is
	// released and used again (a new operation); p-finished is taken
	// over and its attempt fails again (abandoned as before, by another
	// attempt).
	retried := mustLease(t, s, params("u1", "p-retried", "fp1"))
	rp := params("u1", "p-redriven", "fp1")
	rp.Owner = idemdriver.NewOwner()
	rp.Redrive = &idemdriver.RedriveParams{CreatedAt: redrivenInfo.CreatedAt}
	redriven := mustLease(t, s, rp)
	rl := mustLease(t, s, params("u1", "p-renewed", "fp1"))
	if err := s.Release(ctx, rl); err != nil {
		t.Fatalf("Release: %v", err)
	}
	clk.Advance(time.Millisecond)
	if err := s.Fail(ctx, mustLease(t, s, params("u1", "p-renewed", "fp1"))); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	if err := s.Fail(ctx, mustLease(t, s, params("u1", "p-finished", "fp1"))); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	clk.Advance(time.Millisecond)

	for _, c := range []struct {
		key     string
		seen    idemdriver.Seen
		state   idemdriver.KeyState
		changed bool
	}{
		{"p-done", doneSeen, idemdriver.KeyCompleted, false},
		{"p-flight", flightSeen, idemdriver.KeyInFlight, false},
		{"p-retried", retriedSeen, idemdriver.KeyInFlight, true},
		{"p-redriven", redrivenSeen, idemdriver.KeyInFlight, true},
		{"p-renewed", renewedSeen, idemdriver.KeyAbandoned, true},
		{"p-finished", finishedSeen, idemdriver.KeyAbandoned, true},
	} {
		before, _ := s.Get(ctx, "u1", c.key)
		rec, err := pu.Purge(ctx, "u1", c.key, c.seen)
		if rec != nil {
			t.Errorf("Purge(%s) refused, yet returned a record: %+v", c.key, rec)
		}
		wantNotPurgeable(t, c.key, err, c.state, c.changed)
		after, err := s.Get(ctx, "u1", c.key)
		if err != nil || before == nil || after.Owner != before.Owner || after.Attempts != before.Attempts ||
			!after.CreatedAt.Equal(before.CreatedAt) || !after.LeaseUntil.Equal(before.LeaseUntil) || (after.Response == nil) != (before.Response == nil) {
			t.Errorf("Purge(%s) refused, yet the record changed: %+v, then %+v, %v", c.key, before, after, err)
		}
	}
	for _, c := range []struct {
		key  string
		seen idemdriver.Seen
	}{
		{"p-expired", expiredSeen},
		{"p-none", idemdriver.Seen{Owner: "nobody", Attempts: 1, CreatedAt: clockStart}},
	} {
		if rec, err := pu.Purge(ctx, "u1", c.key, c.seen); !errors.Is(err, idem.ErrNotFound) || rec != nil {
			t.Errorf("Purge(%s) = %+v, %v; want ErrNotFound", c.key, rec, err)
		}
	}
	// Another user's key of that name is not the one seen.
	if rec, err := pu.Purge(ctx, "u2", "p-finished", finishedSeen); !errors.Is(err, idem.ErrNotFound) || rec != nil {
		t.Errorf("Purge of another user's key = %+v, %v; want ErrNotFound", rec, err)
	}
	// The attempts that took keys over are still theirs to finish.
	if err := run(ctx, h, s, retried, "purge-p-retried", response("retried")); err != nil {
		t.Errorf("the client's retry after a refused Purge: %v", err)
	}
	if err := run(ctx, h, s, redriven, "purge-p-redriven", response("redriven")); err != nil {
		t.Errorf("the completer's re-drive after a refused Purge: %v", err)
	}
}

// testPurgeDeletes: Purge deletes an abandoned key and a given-up one as
// inspected, and returns the record; the key is then free: the next
// request with it starts a new operation, and the purged attempt's late
// completion is fenced, its effect not committed.
func testPurgeDeletes(t *testing.T, h Harness) {
	ctx := context.Background()
	s, pu, in, clk := purger(t, h)
	p := params("u1", "p-abandoned", "fp1")
	slow := mustLease(t, s, p) // an attempt still running, its lease run out
	giveUp(t, s, params("u1", "p-given-up", "fp1"), 2)
	clk.Advance(time.Minute)
	info, seen := inspectSeen(t, in, "u1", "p-abandoned")
	if info.State != idemdriver.KeyAbandoned {
		t.Fatalf("p-abandoned is %s, want abandoned", info.State)
	}
	rec, err := pu.Purge(ctx, "u1", "p-abandoned", seen)
	if err != nil || rec == nil || rec.Owner != slow.Owner || !rec.CreatedAt.Equal(slow.CreatedAt) || rec.Attempts != 1 ||
		rec.Fingerprint != "fp1" || rec.Response != nil {
		t.Fatalf("Purge(p-abandoned) = %+v, %v; want the record of the slow attempt", rec, err)
	}
	if _, err := s.Get(ctx, "u1", "p-abandoned"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get after Purge: %v, want ErrNotFound", err)
	}
	if _, err := in.InspectKey(ctx, "u1", "p-abandoned", 0); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("InspectKey after Purge: %v, want ErrNotFound", err)
	}
	if _, err := pu.Purge(ctx, "u1", "p-abandoned", seen); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("second Purge: %v, want ErrNotFound", err)
	}
	if err := run(ctx, h, s, slow, "purge-slow", response("slow")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("the purged attempt's late Complete: %v, want ErrFenced", err)
	}
	if got := count(t, h, s, "purge-slow"); got != 0 {
		t.Errorf("the purged attempt's effects = %d, want 0", got)
	}
	// The retry runs again, as a new operation.
	again := mustLease(t, s, p)
	if again.Attempt != 1 || !again.CreatedAt.After(slow.CreatedAt) || again.Owner == slow.Owner {
		t.Errorf("retry after Purge = %+v; want a new operation (attempt 1, a later CreatedAt)", again)
	}
	// The purged attempt, completing once the key holds the new
	// operation, is fenced still: it never answers for the new one.
	if err := run(ctx, h, s, slow, "purge-slow", response("slow")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("the purged attempt's Complete over the new operation: %v, want ErrFenced", err)
	}
	if err := run(ctx, h, s, again, "purge-again", response("again")); err != nil {
		t.Fatalf("the retry's run: %v", err)
	}
	if got := count(t, h, s, "purge-again"); got != 1 {
		t.Errorf("the retry's effects = %d, want 1", got)
	}

	ginfo, err := in.InspectKey(ctx, "u1", "p-given-up", 2)
	if err != nil || ginfo.State != idemdriver.KeyGivenUp {
		t.Fatalf("InspectKey(p-given-up) = %+v, %v; want given-up", ginfo, err)
	}
	gseen := idemdriver.SeenOf(&ginfo.Record)
	if rec, err := pu.Purge(ctx, "u1", "p-given-up", gseen); err != nil || rec.Attempts != 3 || rec.Redrives != 2 {
		t.Fatalf("Purge(p-given-up) = %+v, %v; want the record, 3 attempts, 2 re-drives", rec, err)
	}
	if infos, err := in.ListKeys(ctx, idemdriver.ListParams{State: idemdriver.KeyGivenUp, Limit: 10, MaxRedrives: 2}); err != nil || len(infos) != 0 {
		t.Errorf("ListKeys(given-up) after Purge = %d keys, %v; want none", len(infos), err)
	}
	if sw, ok := s.(idemdriver.Sweeper); ok {
		if recs, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10}); err != nil || len(recs) != 0 {
			t.Errorf("Abandoned after Purge = %s, %v; want none", keys(recs), err)
		}
	}
}

// testPurgeRacesLateComplete: the attempt whose lease ran out completes
// while an operator purges its key: exactly one of them wins. Either the
// outcome committed, with its effect, and Purge was refused (completed),
// or the key is gone and the completion was fenced, with no effect.
func testPurgeRacesLateComplete(t *testing.T, h Harness) {
	ctx := context.Background()
	s, pu, in, clk := purger(t, h)
	const keysN = 12
	purged := 0
	for i := range keysN {
		key := fmt.Sprintf("p-late-%d", i)
		name := "purge-late-" + key
		slow := mustLease(t, s, params("u1", key, "fp1"))
		clk.Advance(time.Minute)
		_, seen := inspectSeen(t, in, "u1", key)
		var (
			wg                 sync.WaitGroup
			purgeErr, complErr error
			start              = make(chan struct{})
		)
		wg.Add(2)
		go func() {
			defer wg.Done()
			<-start
			_, purgeErr = pu.Purge(ctx, "u1", key, seen)
		}()
		go func() {
			defer wg.Done()
			<-start
			complErr = run(ctx, h, s, slow, name, response(key))
		}()
		close(start)
		wg.Wait()
		effects := count(t, h, s, name)
		rec, getErr := s.Get(ctx, "u1", key)
		switch {
		case purgeErr == nil:
			purged++
			if !errors.Is(complErr, idem.ErrFenced) || effects != 0 || !errors.Is(getErr, idem.ErrNotFound) {
				t.Errorf("%s: purged, yet Complete = %v, %d effects, Get = %+v, %v; want ErrFenced, none, ErrNotFound", key, complErr, effects, rec, getErr)
			}
		case errors.Is(purgeErr, idemdriver.ErrNotPurgeable):
			wantNotPurgeable(t, key, purgeErr, idemdriver.KeyCompleted, false)
			if complErr != nil || effects != 1 || getErr != nil || rec.Response == nil {
				t.Errorf("%s: Purge refused, yet Complete = %v, %d effects, Get = %+v, %v; want the outcome committed", key, complErr, effects, rec, getErr)
			}
		default:
			// A serialization failure of a stricter isolation: then
			// the completion decides alone.
			t.Logf("%s: Purge: %v", key, purgeErr)
			if complErr == nil && effects != 1 || complErr != nil && effects != 0 {
				t.Errorf("%s: Complete = %v with %d effects", key, complErr, effects)
			}
		}
	}
	t.Logf("Purge won %d of %d races with the late completion", purged, keysN)
}

// testPurgeRacesTakeover: clients' retries and a completer's re-drive
// race a purge of the key they take over: exactly one lease is handed
// out, whoever came first, and it is never lost: its outcome commits
// once, with its effect. When the purge came first, the lease is of a new
// operation; otherwise the purge is refused.
func testPurgeRacesTakeover(t *testing.T, h Harness) {
	ctx := context.Background()
	s, pu, in, clk := purger(t, h)
	const (
		keysN   = 8
		clients = 6
	)
	purgedFirst := 0
	for i := range keysN {
		p := params("u1", fmt.Sprintf("p-race-%d", i), "fp1")
		first := mustLease(t, s, p)
		if err := s.Fail(ctx, first); err != nil {
			t.Fatalf("Fail: %v", err)
		}
		clk.Advance(time.Millisecond) // a new operation would have another CreatedAt
		_, seen := inspectSeen(t, in, p.User, p.Key)
		name := "purge-race-" + p.Key
		var (
			wg       sync.WaitGroup
			leases   atomic.Int64
			commits  atomic.Int64
			purged   atomic.Bool
			mu       sync.Mutex
			errs     []error
			newOp    atomic.Bool
			start    = make(chan struct{})
			report   = func(err error) { mu.Lock(); errs = append(errs, err); mu.Unlock() }
			claimRun = func(q idemdriver.ClaimParams, who string) {
				defer wg.Done()
				<-start
				c, err := s.Claim(ctx, q)
				switch {
				case err == nil && c.Lease != nil:
					leases.Add(1)
					if !c.Lease.CreatedAt.Equal(first.CreatedAt) {
						newOp.Store(true)
					}
					if err := run(ctx, h, s, c.Lease, name, response(who)); err != nil {
						report(fmt.Errorf("%s: %s's lease was lost: %w", p.Key, who, err))
						return
					}
					commits.Add(1)
				case errors.Is(err, idem.ErrInFlight), errors.Is(err, idem.ErrNotDue):
				case err == nil && c.Response != nil:
				default:
					report(fmt.Errorf("%s: %s's claim: %+v, %w", p.Key, who, c, err))
				}
			}
		)
		for j := range clients {
			q := p
			q.Owner = idemdriver.NewOwner()
			wg.Add(1)
			go claimRun(q, fmt.Sprintf("client-%d", j))
		}
		q := p
		q.Owner = idemdriver.NewOwner()
		q.Redrive = &idemdriver.RedriveParams{CreatedAt: first.CreatedAt}
		wg.Add(2)
		go claimRun(q, "completer")
		go func() {
			defer wg.Done()
			<-start
			rec, err := pu.Purge(ctx, p.User, p.Key, seen)
			switch {
			case err == nil:
				purged.Store(true)
				if rec.Owner != first.Owner {
					report(fmt.Errorf("%s: Purge deleted the record of %s, not the one seen (%s)", p.Key, rec.Owner, first.Owner))
				}
			case errors.Is(err, idemdriver.ErrNotPurgeable):
			default:
				report(fmt.Errorf("%s: Purge: %w", p.Key, err))
			}
		}()
		close(start)
		wg.Wait()
		for _, err := range errs {
			t.Error(err)
		}
		if leases.Load() != 1 || commits.Load() != 1 {
			t.Errorf("%s: %d leases handed out, %d outcomes committed; want exactly one of each", p.Key, leases.Load(), commits.Load())
		}
		if got := count(t, h, s, name); got != 1 {
			t.Errorf("%s: %d effects, want 1", p.Key, got)
		}
		rec, err := s.Get(ctx, p.User, p.Key)
		if err != nil || rec.Response == nil {
			t.Errorf("%s: Get = %+v, %v; want the committed outcome", p.Key, rec, err)
		} else if purged.Load() != newOp.Load() || purged.Load() == rec.CreatedAt.Equal(first.CreatedAt) {
			t.Errorf("%s: purged %v, lease of a new operation %v, record's operation %v (first %v); want a new operation exactly when purged",
				p.Key, purged.Load(), newOp.Load(), rec.CreatedAt, first.CreatedAt)
		}
		if purged.Load() {
			purgedFirst++
		}
	}
	t.Logf("Purge came first for %d of %d keys", purgedFirst, keysN)
}
