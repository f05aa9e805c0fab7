package storetest

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/idem-go/idem/idemdriver"
)

func testSweeper(t *testing.T, h Harness) {
	ctx := context.Background()
	s, advance := aging(t, h)
	sw, ok := s.(idemdriver.Sweeper)
	if !ok {
		t.Skip("store does not implement idemdriver.Sweeper")
	}
	short := params("u1", "k-abandoned", "fp1")
	short.Lease = 50 * time.Millisecond
	mustLease(t, s, short) // abandoned once its lease runs out
	mustLease(t, s, params("u1", "k-live", "fp1"))

	exp := params("u1", "k-expired", "fp1")
	exp.TTL = 100 * time.Millisecond
	l := mustLease(t, s, exp)
	if err := run(ctx, h, s, l, "sweep", response("x")); err != nil {
		t.Fatalf("run: %v", err)
	}
	leasedExp := params("u1", "k-expired-leased", "fp1")
	leasedExp.TTL = 100 * time.Millisecond
	leasedExp.Lease = 10 * time.Second
	mustLease(t, s, leasedExp)
	advance(200 * time.Millisecond)

	recs, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10})
	if err != nil {
		t.Fatalf("Abandoned: %v", err)
	}
	if len(recs) != 1 || recs[0].Key != "k-abandoned" || !bytes.Equal(recs[0].Body, short.Body) {
		t.Errorf("Abandoned = %+v, want k-abandoned alone, with its body", recs)
	}
	n, err := sw.DeleteExpired(ctx, 10)
	if err != nil {
		t.Fatalf("DeleteExpired: %v", err)
	}
	if n != 1 {
		t.Errorf("DeleteExpired = %d, want 1 (the leased expired key stays)", n)
	}
	if _, err := s.Get(ctx, "u1", "k-live"); err != nil {
		t.Errorf("live key: %v", err)
	}
}

// testAbandonedOrder: Abandoned lists the requests without an answer whose
// lease ended (run out or failed), expired or not, the longest waiting
// (earliest lease end) first, up to its limit, with what is needed to run
// them again.
func testAbandonedOrder(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	sw, ok := s.(idemdriver.Sweeper)
	if !ok {
		t.Skip("store does not implement idemdriver.Sweeper")
	}
	short := func(key string) idemdriver.ClaimParams {
		p := params("u1", key, "fp1")
		p.Lease = time.Second
		return p
	}
	mustLease(t, s, short("a-oldest"))
	clk.Advance(time.Millisecond)
	failed := mustLease(t, s, params("u1", "failed", "fp1"))
	if err := s.Fail(ctx, failed); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	clk.Advance(time.Millisecond)
	mustLease(t, s, short("a-middle"))
	clk.Advance(time.Millisecond)
	done := mustLease(t, s, short("done"))
	if err := run(ctx, h, s, done, "abandoned-done", response("done")); err != nil {
		t.Fatalf("run: %v", err)
	}
	clk.Advance(time.Millisecond)
	exp := short("expired")
	exp.TTL = time.Second
	mustLease(t, s, exp)
	clk.Advance(time.Millisecond)
	mustLease(t, s, short("a-newest"))
	clk.Advance(time.Millisecond)
	mustLease(t, s, params("u1", "live", "fp1")) // a 10s lease

	if recs, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10}); err != nil || keys(recs) != "failed" {
		t.Errorf("Abandoned before the leases ran out = %s, %v; want failed alone", keys(recs), err)
	}
	clk.Advance(2 * time.Second)
	recs, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10})
	if err != nil {
		t.Fatalf("Abandoned: %v", err)
	}
	if got, want := keys(recs), "failed a-oldest a-middle expired a-newest"; got != want {
		t.Errorf("Abandoned = %s, want %s (earliest lease end first)", got, want)
	}
	want := short("a-oldest")
	if len(recs) > 1 && (recs[1].Method != want.Method || recs[1].Path != want.Path ||
		!bytes.Equal(recs[1].Body, want.Body) || recs[1].Header.Get("Content-Type") != "application/json" ||
		recs[1].Fingerprint != want.Fingerprint || recs[1].Attempts != 1 || recs[1].Redrives != 0) {
		t.Errorf("Abandoned[1] = %+v, want the stored request", recs[1])
	}
	if recs, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 2}); err != nil || keys(recs) != "failed a-oldest" {
		t.Errorf("Abandoned(2) = %s, %v; want the two longest waiting", keys(recs), err)
	}
	if recs, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 0}); err != nil || len(recs) != 0 {
		t.Errorf("Abandoned(0) = %s, %v; want none", keys(recs), err)
	}

	// A key retried and failed again has waited least: it comes last.
	again := mustLease(t, s, short("a-oldest"))
	if err := s.Fail(ctx, again); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	if recs, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 3}); err != nil || keys(recs) != "failed a-middle expired" {
		t.Errorf("Abandoned(3) after a-oldest failed again = %s, %v; want the keys waiting longer", keys(recs), err)
	}
}

// testDeleteExpiredBatches: DeleteExpired deletes expired completed keys up
// to its limit, and never a key without an answer, expired or not, leased,
// failed or abandoned: its attempt may have paid, and the completer must
// still be able to finish it.
func testDeleteExpiredBatches(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	sw, ok := s.(idemdriver.Sweeper)
	if !ok {
		t.Skip("store does not implement idemdriver.Sweeper")
	}
	short := func(key string, ttl, lease time.Duration) idemdriver.ClaimParams {
		p := params("u1", key, "fp1")
		p.TTL, p.Lease = ttl, lease
		return p
	}
	for _, k := range []string{"completed-1", "completed-2", "completed-3"} {
		l := mustLease(t, s, short(k, time.Second, time.Second))
		if err := run(ctx, h, s, l, "delete-"+k, response(k)); err != nil {
			t.Fatalf("run: %v", err)
		}
	}
	mustLease(t, s, short("abandoned", time.Second, time.Millisecond))
	mustLease(t, s, short("leased", time.Second, time.Minute))
	failing := mustLease(t, s, short("failing", time.Second, time.Hour))
	live := mustLease(t, s, short("live", time.Hour, time.Second))
	if err := run(ctx, h, s, live, "delete-live", response("live")); err != nil {
		t.Fatalf("run: %v", err)
	}
	clk.Advance(2 * time.Second)

	for _, c := range []struct{ limit, want int }{{0, 0}, {2, 2}, {10, 1}, {10, 0}} {
		if n, err := sw.DeleteExpired(ctx, c.limit); err != nil || n != c.want {
			t.Errorf("DeleteExpired(%d) = %d, %v; want %d", c.limit, n, err, c.want)
		}
	}
	if err := s.Fail(ctx, failing); err != nil {
		t.Fatalf("Fail of the expired, leased key: %v", err)
	}
	clk.Advance(time.Hour - 3*time.Second) // "live" has a second left
	if n, err := sw.DeleteExpired(ctx, 10); err != nil || n != 0 {
		t.Errorf("DeleteExpired after the leases ended = %d, %v; want 0", n, err)
	}
	for _, k := range []string{"abandoned", "leased", "failing"} {
		if rec, err := s.Get(ctx, "u1", k); err != nil || rec.Response != nil {
			t.Errorf("Get(%s) = %+v, %v; want the unanswered record, kept", k, rec, err)
		}
	}
	if _, err := s.Get(ctx, "u1", "live"); err != nil {
		t.Errorf("live key: %v", err)
	}
	clk.Advance(time.Second)
	if n, err := sw.DeleteExpired(ctx, 10); err != nil || n != 1 {
		t.Errorf("DeleteExpired once the last answer expired = %d, %v; want 1", n, err)
	}
}
