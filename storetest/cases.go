package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
)

func params(user, key, fp string) idem.ClaimParams {
	return idem.ClaimParams{
		User:        user,
		Key:         key,
		Fingerprint: fp,
		Method:      http.MethodPost,
		Path:        "/v1/things",
		Header:      http.Header{"Content-Type": {"application/json"}},
		Body:        []byte(`{"n":1}`),
		Lease:       10 * time.Second,
		TTL:         time.Hour,
	}
}

func response(body string) *idem.Response {
	return &idem.Response{
		Status: http.StatusCreated,
		Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/v1/things/1"}},
		Body:   []byte(body),
	}
}

func mustLease(t *testing.T, s idem.Store, p idem.ClaimParams) *idem.Lease {
	t.Helper()
	c, err := s.Claim(context.Background(), p)
	if err != nil {
		t.Fatalf("Claim(%s/%s): %v", p.User, p.Key, err)
	}
	if c.Lease == nil {
		t.Fatalf("Claim(%s/%s): got response %+v, want a lease", p.User, p.Key, c.Response)
	}
	return c.Lease
}

// run does what the middleware does with a lease: write effect name and
// commit the outcome resp.
func run(ctx context.Context, h Harness, s idem.Store, l *idem.Lease, name string, resp *idem.Response) error {
	tx, err := s.Begin(ctx, l)
	if err != nil {
		return fmt.Errorf("Begin: %w", err)
	}
	if err := h.Write(ctx, tx, name); err != nil {
		tx.Rollback(ctx)
		return fmt.Errorf("Write: %w", err)
	}
	return tx.Complete(ctx, resp)
}

func count(t *testing.T, h Harness, s idem.Store, name string) int {
	t.Helper()
	n, err := h.Count(context.Background(), s, name)
	if err != nil {
		t.Fatalf("Count(%q): %v", name, err)
	}
	return n
}

func sameResponse(t *testing.T, got, want *idem.Response) {
	t.Helper()
	if got == nil {
		t.Fatalf("got no response, want %d %q", want.Status, want.Body)
	}
	if got.Status != want.Status || !bytes.Equal(got.Body, want.Body) {
		t.Fatalf("got response %d %q, want %d %q", got.Status, got.Body, want.Status, want.Body)
	}
	for _, k := range []string{"Content-Type", "Location"} {
		if g, w := got.Header.Get(k), want.Header.Get(k); g != w {
			t.Fatalf("got header %s %q, want %q", k, g, w)
		}
	}
}

func testSequentialReplay(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	p := params("u1", "k-replay", "fp1")
	l := mustLease(t, s, p)
	if l.Attempt != 1 {
		t.Errorf("first lease Attempt = %d, want 1", l.Attempt)
	}
	want := response(`{"id":"1"}`)
	if err := run(ctx, h, s, l, "replay", want); err != nil {
		t.Fatalf("run: %v", err)
	}
	for i := 0; i < 3; i++ {
		c, err := s.Claim(ctx, p)
		if err != nil {
			t.Fatalf("repeat %d: Claim: %v", i, err)
		}
		if c.Lease != nil {
			t.Fatalf("repeat %d: got a lease for a completed key", i)
		}
		sameResponse(t, c.Response, want)
	}
	if got := count(t, h, s, "replay"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
	rec, err := s.Get(ctx, "u1", "k-replay")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Response == nil || rec.CompletedAt.IsZero() {
		t.Errorf("Get: record not completed: %+v", rec)
	}
}

func testMismatch(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	l := mustLease(t, s, params("u1", "k-mismatch", "fp1"))
	// In flight with another fingerprint: refused as a mismatch.
	if _, err := s.Claim(ctx, params("u1", "k-mismatch", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("in flight, other fingerprint: got %v, want ErrFingerprintMismatch", err)
	}
	if err := run(ctx, h, s, l, "mismatch", response("a")); err != nil {
		t.Fatalf("run: %v", err)
	}
	if _, err := s.Claim(ctx, params("u1", "k-mismatch", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("completed, other fingerprint: got %v, want ErrFingerprintMismatch", err)
	}
}

func testInFlight(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	p := params("u1", "k-inflight", "fp1")
	l := mustLease(t, s, p)
	_, err := s.Claim(ctx, p)
	var ife *idem.InFlightError
	if !errors.As(err, &ife) || !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("second claim: got %v, want *InFlightError", err)
	}
	if d := ife.LeaseUntil.Sub(l.Until); d < -time.Second || d > time.Second {
		t.Errorf("LeaseUntil = %v, want about %v", ife.LeaseUntil, l.Until)
	}
	if left := time.Until(ife.LeaseUntil); left < 5*time.Second {
		t.Errorf("lease left = %v, want about 10s", left)
	}
}

func testConcurrentClaims(t *testing.T, h Harness) {
	s := h.New(t)
	p := params("u1", "k-race", "fp1")
	const n = 100
	var leases, inflight, other atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			c, err := s.Claim(context.Background(), p)
			switch {
			case err == nil && c.Lease != nil:
				leases.Add(1)
			case errors.Is(err, idem.ErrInFlight):
				inflight.Add(1)
			default:
				other.Add(1)
				t.Errorf("Claim: %+v, %v", c, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if leases.Load() != 1 || inflight.Load() != n-1 {
		t.Fatalf("leases = %d, in flight = %d, other = %d; want 1, %d, 0", leases.Load(), inflight.Load(), other.Load(), n-1)
	}
}

// testConcurrentRetriesExecuteOnce has 100 clients retry one request until
// each gets an answer: the work runs once and every client sees its answer.
func testConcurrentRetriesExecuteOnce(t *testing.T, h Harness) {
	s := h.New(t)
	p := params("u1", "k-retries", "fp1")
	want := response(`{"id":"once"}`)
	const n = 100
	var wg sync.WaitGroup
	var executions atomic.Int64
	start := make(chan struct{})
	deadline := time.Now().Add(30 * time.Second)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			ctx := context.Background()
			for time.Now().Before(deadline) {
				c, err := s.Claim(ctx, p)
				switch {
				case errors.Is(err, idem.ErrInFlight):
					time.Sleep(2 * time.Millisecond)
					continue
				case err != nil:
					t.Errorf("Claim: %v", err)
					return
				case c.Lease != nil:
					executions.Add(1)
					if err := run(ctx, h, s, c.Lease, "retries", want); err != nil {
						t.Errorf("run: %v", err)
						return
					}
					continue // the next claim replays
				}
				sameResponse(t, c.Response, want)
				return
			}
			t.Errorf("no answer before the deadline")
		}()
	}
	close(start)
	wg.Wait()
	if got := executions.Load(); got != 1 {
		t.Errorf("executions = %d, want 1", got)
	}
	if got := count(t, h, s, "retries"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
}

func testLeaseTakeover(t *testing.T, h Harness) {
	s := h.New(t)
	p := params("u1", "k-takeover", "fp1")
	p.Lease = 150 * time.Millisecond
	first := mustLease(t, s, p)
	if _, err := s.Claim(context.Background(), p); !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("claim within lease: got %v, want ErrInFlight", err)
	}
	time.Sleep(250 * time.Millisecond)
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
	s := h.New(t)
	p := params("u1", "k-fenced", "fp1")
	p.Lease = 150 * time.Millisecond
	slow := mustLease(t, s, p)
	time.Sleep(250 * time.Millisecond)
	p.Lease = 10 * time.Second
	fast := mustLease(t, s, p)

	if err := run(ctx, h, s, slow, "fenced-slow", response("slow")); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("slow attempt Complete: got %v, want ErrFenced", err)
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

func testRelease(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	l := mustLease(t, s, params("u1", "k-release", "fp1"))
	if err := s.Release(ctx, l); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if _, err := s.Get(ctx, "u1", "k-release"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get after Release: got %v, want ErrNotFound", err)
	}
	// A corrected request may reuse the key.
	l2 := mustLease(t, s, params("u1", "k-release", "fp2"))
	if l2.Attempt != 1 {
		t.Errorf("Attempt after release = %d, want 1", l2.Attempt)
	}
	if err := s.Release(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("stale Release: got %v, want ErrFenced", err)
	}
}

func testFail(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	p := params("u1", "k-fail", "fp1")
	l := mustLease(t, s, p)
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if err := h.Write(ctx, tx, "fail"); err != nil {
		t.Fatalf("Write: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	if err := s.Fail(ctx, l); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	if _, err := s.Claim(ctx, params("u1", "k-fail", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("other body after a failure: got %v, want ErrFingerprintMismatch", err)
	}
	l2 := mustLease(t, s, p) // the lease ended: the same request runs again at once
	if l2.Attempt != 2 || l2.Owner == l.Owner {
		t.Errorf("retry after failure: Attempt %d owner %q, want 2 and a new owner", l2.Attempt, l2.Owner)
	}
	if err := run(ctx, h, s, l2, "fail", response("ok")); err != nil {
		t.Fatalf("retry: %v", err)
	}
	if got := count(t, h, s, "fail"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
}

func testCompleteNil(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	l := mustLease(t, s, params("u1", "k-nil", "fp1"))
	if err := run(ctx, h, s, l, "nil", nil); err != nil {
		t.Fatalf("run: %v", err)
	}
	if got := count(t, h, s, "nil"); got != 1 {
		t.Errorf("effects = %d, want 1: the work stands", got)
	}
	if _, err := s.Get(ctx, "u1", "k-nil"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get: got %v, want ErrNotFound: the key is free", err)
	}
}

func testRollback(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	l := mustLease(t, s, params("u1", "k-rollback", "fp1"))
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if err := h.Write(ctx, tx, "rollback"); err != nil {
		t.Fatalf("Write: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	if err := s.Release(ctx, l); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if got := count(t, h, s, "rollback"); got != 0 {
		t.Errorf("effects = %d, want 0", got)
	}
}

func testExpiry(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	p := params("u1", "k-expiry", "fp1")
	p.TTL = 200 * time.Millisecond
	l := mustLease(t, s, p)
	if err := run(ctx, h, s, l, "expiry", response("old")); err != nil {
		t.Fatalf("run: %v", err)
	}
	time.Sleep(300 * time.Millisecond)
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

func testUserScope(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	a := mustLease(t, s, params("alice", "k-shared", "fp-a"))
	if err := run(ctx, h, s, a, "scope-alice", response("alice")); err != nil {
		t.Fatalf("alice: %v", err)
	}
	b := mustLease(t, s, params("bob", "k-shared", "fp-b"))
	if err := run(ctx, h, s, b, "scope-bob", response("bob")); err != nil {
		t.Fatalf("bob: %v", err)
	}
	for user, want := range map[string]string{"alice": "alice", "bob": "bob"} {
		c, err := s.Claim(ctx, params(user, "k-shared", "fp-"+user[:1]))
		if err != nil {
			t.Fatalf("%s replay: %v", user, err)
		}
		sameResponse(t, c.Response, response(want))
	}
}

func testRecordKeepsRequest(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	p := params("u1", "k-record", "fp1")
	mustLease(t, s, p)
	rec, err := s.Get(ctx, "u1", "k-record")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.User != p.User || rec.Key != p.Key || rec.Fingerprint != p.Fingerprint ||
		rec.Method != p.Method || rec.Path != p.Path || !bytes.Equal(rec.Body, p.Body) ||
		rec.Header.Get("Content-Type") != "application/json" || rec.Response != nil || rec.Attempts != 1 {
		t.Errorf("Get = %+v, want the claimed request", rec)
	}
	if d := rec.ExpiresAt.Sub(rec.CreatedAt); d < 59*time.Minute || d > 61*time.Minute {
		t.Errorf("ExpiresAt - CreatedAt = %v, want the TTL (1h)", d)
	}
}

func testSweeper(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	sw, ok := s.(idem.Sweeper)
	if !ok {
		t.Skip("store does not implement idem.Sweeper")
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
	time.Sleep(200 * time.Millisecond)

	recs, err := sw.Abandoned(ctx, 10)
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
