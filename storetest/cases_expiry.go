package storetest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

func testExpiry(t *testing.T, h Harness) {
	ctx := context.Background()
	s, advance := aging(t, h)
	p := params("u1", "k-expiry", "fp1")
	p.TTL = 200 * time.Millisecond
	l := mustLease(t, s, p)
	if err := run(ctx, h, s, l, "expiry", response("old")); err != nil {
		t.Fatalf("run: %v", err)
	}
	advance(300 * time.Millisecond)
	if _, err := s.Get(ctx, "u1", "k-expiry"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get after expiry: got %v, want ErrNotFound", err)
	}
	// After expiry the same key starts a new operation, whatever its body.
	p2 := params("u1", "k-expiry", "fp2")
	l2 := mustLease(t, s, p2)
	if l2.Attempt != 1 {
		t.Errorf("Attempt after expiry = %d, want 1", l2.Attempt)
	}
	if err := run(ctx, h, s, l2, "expiry", response("new")); err != nil {
		t.Fatalf("run after expiry: %v", err)
	}
	c, err := s.Claim(ctx, p2)
	if err != nil {
		t.Fatalf("replay: %v", err)
	}
	sameResponse(t, c.Response, response("new"))
}

// testExpiryBoundary: a key lives until just before its expiry; at it the
// key is gone and starts a new operation, whatever its body, and the old
// lease is fenced off.
func testExpiryBoundary(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	p := params("u1", "k-expiry-boundary", "fp1")
	p.TTL = time.Minute
	l := mustLease(t, s, p)
	if err := run(ctx, h, s, l, "expiry-old", response("old")); err != nil {
		t.Fatalf("run: %v", err)
	}
	clk.Advance(p.TTL - time.Nanosecond)
	if _, err := s.Get(ctx, p.User, p.Key); err != nil {
		t.Errorf("Get just before expiry: %v", err)
	}
	if c, err := s.Claim(ctx, p); err != nil || c.Response == nil {
		t.Errorf("claim just before expiry = %+v, %v; want the replay", c, err)
	}
	clk.Advance(time.Nanosecond)
	if _, err := s.Get(ctx, p.User, p.Key); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get at expiry: got %v, want ErrNotFound", err)
	}

	p2 := params("u1", "k-expiry-boundary", "fp2")
	l2 := mustLease(t, s, p2)
	now := clk.Now()
	if l2.Attempt != 1 || !l2.CreatedAt.Equal(now) || l2.CreatedAt.Equal(l.CreatedAt) {
		t.Errorf("lease after expiry = %+v, want attempt 1, created %v", l2, now)
	}
	rec, err := s.Get(ctx, p2.User, p2.Key)
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Fingerprint != "fp2" || rec.Response != nil || !rec.CompletedAt.IsZero() || rec.Attempts != 1 ||
		!rec.CreatedAt.Equal(now) || !rec.ExpiresAt.Equal(now.Add(p2.TTL)) {
		t.Errorf("record after expiry = %+v, want a fresh one for fp2", rec)
	}
	if err := run(ctx, h, s, l, "expiry-stale", response("stale")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("the expired record's lease: got %v, want ErrFenced", err)
	}
	if got := count(t, h, s, "expiry-stale"); got != 0 {
		t.Errorf("stale effects = %d, want 0", got)
	}
	if err := run(ctx, h, s, l2, "expiry-new", response("new")); err != nil {
		t.Fatalf("run after expiry: %v", err)
	}
	c, err := s.Claim(ctx, p2)
	if err != nil {
		t.Fatalf("replay: %v", err)
	}
	sameResponse(t, c.Response, response("new"))
}

// testExpiryWhileLeased: expiry never takes a key from an attempt that may
// have paid. A key whose TTL ran out while its attempt still holds it is
// not replaced: a repeat is in flight, another body is a mismatch, the
// attempt commits, and its answer is kept a TTL again from then, so the
// client's retry replays it instead of starting a second operation.
func testExpiryWhileLeased(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	p := params("u1", "k-expiry-leased", "fp1")
	p.TTL, p.Lease = time.Second, time.Minute
	first := mustLease(t, s, p)
	clk.Advance(2 * p.TTL) // expired, its lease still live
	if _, err := s.Claim(ctx, p); !errors.Is(err, idem.ErrInFlight) {
		t.Errorf("repeat after expiry, lease live: got %v, want ErrInFlight", err)
	}
	if _, err := s.Claim(ctx, params("u1", "k-expiry-leased", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Errorf("other body after expiry, lease live: got %v, want ErrFingerprintMismatch", err)
	}
	if rec, err := s.Get(ctx, p.User, p.Key); err != nil || rec.Owner != first.Owner {
		t.Errorf("Get after expiry, lease live = %+v, %v; want the running attempt's record", rec, err)
	}
	if sw, ok := s.(idemdriver.Sweeper); ok {
		if n, err := sw.DeleteExpired(ctx, 10); err != nil || n != 0 {
			t.Errorf("DeleteExpired of the running attempt's key = %d, %v; want 0", n, err)
		}
	}
	completed := clk.Now()
	if err := run(ctx, h, s, first, "expiry-leased", response("first")); err != nil {
		t.Fatalf("the attempt that outlived the TTL: Complete: %v", err)
	}
	clk.Advance(p.TTL - time.Nanosecond)
	for _, fp := range []string{"fp1", "fp2"} {
		c, err := s.Claim(ctx, params("u1", "k-expiry-leased", fp))
		if fp == "fp2" {
			if !errors.Is(err, idem.ErrFingerprintMismatch) {
				t.Errorf("other body after the late completion: got %v, want ErrFingerprintMismatch", err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("retry after the late completion: %v", err)
		}
		sameResponse(t, c.Response, response("first"))
	}
	if rec, err := s.Get(ctx, p.User, p.Key); err != nil || !rec.ExpiresAt.Equal(completed.Add(p.TTL)) {
		t.Errorf("Get after the late completion = %+v, %v; want it to expire at %v", rec, err, completed.Add(p.TTL))
	}
	if got := count(t, h, s, "expiry-leased"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
	clk.Advance(time.Nanosecond) // now the answer has lived its TTL
	second := mustLease(t, s, params("u1", "k-expiry-leased", "fp2"))
	if second.Attempt != 1 || second.CreatedAt.Equal(first.CreatedAt) {
		t.Errorf("claim after the answer expired = %+v, want a new operation", second)
	}
}

// testExpiredAbandonedIsFinished: a request that was abandoned and whose
// TTL then ran out is still listed by Abandoned, never deleted by
// DeleteExpired, and taken over (same operation: same CreatedAt) by the
// completer or a retry with the same body; another body is a mismatch.
func testExpiredAbandonedIsFinished(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	sw, ok := s.(idemdriver.Sweeper)
	if !ok {
		t.Skip("store does not implement idemdriver.Sweeper")
	}
	p := params("u1", "k-expired-abandoned", "fp1")
	p.TTL, p.Lease = time.Minute, time.Second
	first := mustLease(t, s, p)
	clk.Advance(2 * p.TTL)
	if recs, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10}); err != nil || keys(recs) != p.Key {
		t.Errorf("Abandoned = %s, %v; want %s", keys(recs), err, p.Key)
	}
	if n, err := sw.DeleteExpired(ctx, 10); err != nil || n != 0 {
		t.Errorf("DeleteExpired = %d, %v; want 0", n, err)
	}
	if _, err := s.Claim(ctx, params("u1", p.Key, "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Errorf("other body: got %v, want ErrFingerprintMismatch", err)
	}
	second := mustLease(t, s, p)
	if second.Attempt != 2 || !second.CreatedAt.Equal(first.CreatedAt) || second.Owner == first.Owner {
		t.Errorf("takeover of the expired, abandoned key = %+v, want attempt 2 of the same operation (created %v)", second, first.CreatedAt)
	}
	if err := run(ctx, h, s, second, "expired-abandoned", response("done")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	c, err := s.Claim(ctx, p)
	if err != nil {
		t.Fatalf("replay: %v", err)
	}
	sameResponse(t, c.Response, response("done"))
}
