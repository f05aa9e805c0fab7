package storetest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

// testRedriveClaim: a completer's claim (ClaimParams.Redrive) takes over
// only the operation it listed, only while it is due, and never inserts
// or replaces a record: completers working from lists made at the same
// moment never skip a backoff or spend another operation's budget.
func testRedriveClaim(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	due := idemdriver.AbandonedParams{MaxRedrives: 2, Backoff: time.Second, MaxBackoff: time.Minute}
	redrive := func(p idemdriver.ClaimParams, created time.Time) (idemdriver.Claim, error) {
		p.Redrive, p.Owner = &idemdriver.RedriveParams{CreatedAt: created, Due: due}, idemdriver.NewOwner()
		return s.Claim(ctx, p)
	}
	// No record: nothing is inserted.
	if _, err := redrive(params("u1", "k-none", "fp1"), clockStart); !errors.Is(err, idem.ErrNotDue) {
		t.Errorf("re-drive of a missing key: got %v, want ErrNotDue", err)
	}
	if _, err := s.Get(ctx, "u1", "k-none"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("after the re-drive of a missing key: Get = %v, want ErrNotFound", err)
	}
	// An answered record is left alone.
	pd := params("u1", "k-done", "fp1")
	ld := mustLease(t, s, pd)
	if err := run(ctx, h, s, ld, "redrive-done", response("done")); err != nil {
		t.Fatalf("run: %v", err)
	}
	if _, err := redrive(pd, ld.CreatedAt); !errors.Is(err, idem.ErrNotDue) {
		t.Errorf("re-drive of an answered key: got %v, want ErrNotDue", err)
	}
	// An abandoned record: live lease, then another operation's time,
	// then due, then in its backoff, then out of budget.
	p := params("u1", "k-redrive", "fp1")
	first := mustLease(t, s, p)
	if _, err := redrive(p, first.CreatedAt); !errors.Is(err, idem.ErrInFlight) {
		t.Errorf("re-drive while the lease is live: got %v, want ErrInFlight", err)
	}
	if err := s.Fail(ctx, first); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	if _, err := redrive(p, first.CreatedAt.Add(-time.Microsecond)); !errors.Is(err, idem.ErrNotDue) {
		t.Errorf("re-drive of another operation on the key: got %v, want ErrNotDue", err)
	}
	if _, err := redrive(params("u1", "k-redrive", "fp2"), first.CreatedAt); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Errorf("re-drive with another fingerprint: got %v, want ErrFingerprintMismatch", err)
	}
	c, err := redrive(p, first.CreatedAt)
	if err != nil || c.Lease == nil || c.Lease.Attempt != 2 {
		t.Fatalf("re-drive once the lease ended = %+v, %v; want the takeover, attempt 2", c, err)
	}
	if err := s.Fail(ctx, c.Lease); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	// A second completer that listed the key before that re-drive: the
	// key is in its backoff now.
	if _, err := redrive(p, first.CreatedAt); !errors.Is(err, idem.ErrNotDue) {
		t.Errorf("stale re-drive right after a failed one: got %v, want ErrNotDue (backoff)", err)
	}
	clk.Advance(time.Second)
	c, err = redrive(p, first.CreatedAt)
	if err != nil || c.Lease == nil {
		t.Fatalf("re-drive after the backoff = %+v, %v; want the takeover", c, err)
	}
	if err := s.Fail(ctx, c.Lease); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	clk.Advance(time.Hour)
	if _, err := redrive(p, first.CreatedAt); !errors.Is(err, idem.ErrNotDue) {
		t.Errorf("re-drive past the budget (2): got %v, want ErrNotDue", err)
	}
	rec, err := s.Get(ctx, p.User, p.Key)
	if err != nil || rec.Attempts != 3 || rec.Redrives != 2 || !rec.CreatedAt.Equal(first.CreatedAt) {
		t.Errorf("record = %+v, %v; want 3 attempts, 2 re-drives, the first operation", rec, err)
	}
	// A client may still take it over (an operator's, or the client's,
	// retry): the budget binds the completers only.
	if l := mustLease(t, s, p); l.Attempt != 4 {
		t.Errorf("client takeover after the budget = attempt %d, want 4", l.Attempt)
	}
}

// testRedrives: a completer's takeovers (ClaimParams.Redrive) are counted
// in Record.Redrives, apart from the clients' attempts, and Abandoned lists
// only the keys due by AbandonedParams: fewer than MaxRedrives re-drives,
// and their backoff passed since their lease ended.
func testRedrives(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	sw, ok := s.(idemdriver.Sweeper)
	if !ok {
		t.Skip("store does not implement idemdriver.Sweeper")
	}
	redrive := func(p idemdriver.ClaimParams) *idemdriver.Lease {
		t.Helper()
		rec, err := s.Get(ctx, p.User, p.Key)
		if err != nil {
			t.Fatalf("Get: %v", err)
		}
		p.Redrive, p.Owner = &idemdriver.RedriveParams{CreatedAt: rec.CreatedAt}, idemdriver.NewOwner()
		l := mustLease(t, s, p)
		if again := mustLease(t, s, p); *again != *l { // a resend counts nothing
			t.Fatalf("resent re-drive = %+v, want %+v", again, l)
		}
		if err := s.Fail(ctx, l); err != nil {
			t.Fatalf("Fail: %v", err)
		}
		return l
	}
	client := func(p idemdriver.ClaimParams) {
		t.Helper()
		if err := s.Fail(ctx, mustLease(t, s, p)); err != nil {
			t.Fatalf("Fail: %v", err)
		}
	}
	pa, pb, pc := params("u1", "k-a", "fp1"), params("u1", "k-b", "fp1"), params("u1", "k-c", "fp1")
	client(pa) // k-a: a client's attempt, then five more: never re-driven
	clk.Advance(time.Millisecond)
	client(pb) // k-b: re-driven twice
	clk.Advance(time.Millisecond)
	client(pc) // k-c: re-driven once
	for range 5 {
		client(pa)
	}
	redrive(pb)
	redrive(pb)
	redrive(pc)
	for _, c := range []struct {
		key                string
		attempts, redrives int
	}{{"k-a", 6, 0}, {"k-b", 3, 2}, {"k-c", 2, 1}} {
		rec, err := s.Get(ctx, "u1", c.key)
		if err != nil || rec.Attempts != c.attempts || rec.Redrives != c.redrives {
			t.Errorf("Get(%s) = attempts %d redrives %d, %v; want %d and %d", c.key, rec.Attempts, rec.Redrives, err, c.attempts, c.redrives)
		}
	}
	// Leases ended in the order k-a (its last client attempt), k-b, k-c.
	p := idemdriver.AbandonedParams{Limit: 10, MaxRedrives: 2, Backoff: time.Second, MaxBackoff: time.Minute}
	if recs, err := sw.Abandoned(ctx, p); err != nil || keys(recs) != "k-a" {
		t.Errorf("Abandoned at once = %s, %v; want k-a (k-b given up, k-c in its 1s backoff)", keys(recs), err)
	}
	clk.Advance(time.Second - time.Nanosecond)
	if recs, err := sw.Abandoned(ctx, p); err != nil || keys(recs) != "k-a" {
		t.Errorf("Abandoned just before the backoff = %s, %v; want k-a", keys(recs), err)
	}
	clk.Advance(time.Nanosecond)
	if recs, err := sw.Abandoned(ctx, p); err != nil || keys(recs) != "k-a k-c" {
		t.Errorf("Abandoned after the backoff = %s, %v; want k-a k-c", keys(recs), err)
	}
	p.MaxRedrives = 0 // no budget: k-b's backoff after 2 re-drives is 2s
	if recs, err := sw.Abandoned(ctx, p); err != nil || keys(recs) != "k-a k-c" {
		t.Errorf("Abandoned without a budget, 1s on = %s, %v; want k-a k-c", keys(recs), err)
	}
	clk.Advance(time.Second)
	if recs, err := sw.Abandoned(ctx, p); err != nil || keys(recs) != "k-a k-b k-c" {
		t.Errorf("Abandoned without a budget, 2s on = %s, %v; want k-a k-b k-c", keys(recs), err)
	}
	if recs, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 1}); err != nil || keys(recs) != "k-a" {
		t.Errorf("Abandoned(1) = %s, %v; want k-a", keys(recs), err)
	}
}
