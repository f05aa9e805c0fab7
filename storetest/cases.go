package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
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

// begin opens l's transaction and writes effect name through it, as a
// handler would.
func begin(t *testing.T, h Harness, s idem.Store, l *idem.Lease, name string) idem.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if err := h.Write(ctx, tx, name); err != nil {
		tx.Rollback(ctx)
		t.Fatalf("Write(%q): %v", name, err)
	}
	return tx
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
	if err := s.Release(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("second Release: got %v, want ErrFenced", err)
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
	tx := begin(t, h, s, l, "fail")
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
	if err := s.Fail(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("stale Fail: got %v, want ErrFenced", err)
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
	if l2 := mustLease(t, s, params("u1", "k-nil", "fp2")); l2.Attempt != 1 {
		t.Errorf("Attempt after a free = %d, want 1", l2.Attempt)
	}
}

func testRollback(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	l := mustLease(t, s, params("u1", "k-rollback", "fp1"))
	tx := begin(t, h, s, l, "rollback")
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
		rec, err := s.Get(ctx, user, "k-shared")
		if err != nil || rec.User != user || rec.Response == nil || string(rec.Response.Body) != want {
			t.Errorf("%s Get: got %+v, %v", user, rec, err)
		}
	}
	// Bob's lease cannot touch Alice's key.
	other := mustLease(t, s, params("bob", "k-other", "fp-b"))
	other.User = "alice"
	mustLease(t, s, params("alice", "k-other", "fp-b"))
	if err := s.Release(ctx, other); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Release of another user's key: got %v, want ErrFenced", err)
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

	recs, err := sw.Abandoned(ctx, idem.AbandonedParams{Limit: 10})
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

// testTxLifecycle checks Rollback and Complete in every order: a rolled
// back transaction commits nothing and cannot complete, Rollback after
// Complete is a no-op, and a completed lease is spent.
func testTxLifecycle(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	p := params("u1", "k-tx", "fp1")
	l := mustLease(t, s, p)

	tx := begin(t, h, s, l, "tx-rolled-back")
	for i := range 2 {
		if err := tx.Rollback(ctx); err != nil {
			t.Fatalf("Rollback %d: %v", i+1, err)
		}
	}
	if err := tx.Complete(ctx, response("x")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Complete after Rollback: got %v, want ErrFenced", err)
	}
	if got := count(t, h, s, "tx-rolled-back"); got != 0 {
		t.Errorf("rolled back effects = %d, want 0", got)
	}

	tx = begin(t, h, s, l, "tx-completed")
	want := response("done")
	if err := tx.Complete(ctx, want); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("Rollback after Complete: %v, want nil", err)
	}
	if err := tx.Complete(ctx, response("again")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("second Complete: got %v, want ErrFenced", err)
	}
	// A completed record is no longer the lease's: the fence holds.
	if err := run(ctx, h, s, l, "tx-again", response("again")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Complete in a new transaction after Complete: got %v, want ErrFenced", err)
	}
	if err := s.Release(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Release after Complete: got %v, want ErrFenced", err)
	}
	if err := s.Fail(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Fail after Complete: got %v, want ErrFenced", err)
	}
	if got := count(t, h, s, "tx-completed") + count(t, h, s, "tx-again"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
	c, err := s.Claim(ctx, p)
	if err != nil {
		t.Fatalf("replay: %v", err)
	}
	sameResponse(t, c.Response, want)
}

// testRoundTrip stores and replays nil, empty and full headers and bodies
// under the empty user (the middleware's default scope): nil stays nil,
// empty stays empty, bytes and repeated header values are kept.
func testRoundTrip(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	for _, tc := range []struct {
		name    string
		header  http.Header
		body    []byte
		trailer http.Header
	}{
		{"nil", nil, nil, nil},
		{"empty", http.Header{}, []byte{}, http.Header{}},
		{"full", http.Header{"Content-Type": {"application/json"}, "X-Many": {"a", "b"}}, []byte{0, 1, 2, 0xff}, nil},
		{"trailers", http.Header{"Content-Type": {"text/plain"}}, []byte("rows\n"),
			http.Header{"X-Checksum": {"sha256=abc"}, "X-Many": {"a", "", "b"}, "Grpc-Status": {"0"}}},
	} {
		p := params("", "k-rt-"+tc.name, "fp1")
		p.Header, p.Body = tc.header, tc.body
		l := mustLease(t, s, p)
		rec, err := s.Get(ctx, "", p.Key)
		if err != nil {
			t.Fatalf("%s: Get: %v", tc.name, err)
		}
		if rec.User != "" || (rec.Body == nil) != (tc.body == nil) || !bytes.Equal(rec.Body, tc.body) {
			t.Errorf("%s: Get = user %q body %#v, want %q and %#v", tc.name, rec.User, rec.Body, "", tc.body)
		}
		if (rec.Header == nil) != (tc.header == nil) || len(rec.Header) != len(tc.header) ||
			len(rec.Header.Values("X-Many")) != len(tc.header.Values("X-Many")) {
			t.Errorf("%s: Header = %#v, want %#v", tc.name, rec.Header, tc.header)
		}
		resp := &idem.Response{Status: http.StatusNoContent, Header: tc.header, Body: tc.body, Trailer: tc.trailer}
		if err := run(ctx, h, s, l, "rt", resp); err != nil {
			t.Fatalf("%s: run: %v", tc.name, err)
		}
		c, err := s.Claim(ctx, p)
		if err != nil {
			t.Fatalf("%s: replay: %v", tc.name, err)
		}
		got := c.Response
		if got == nil || got.Status != resp.Status || (got.Body == nil) != (resp.Body == nil) ||
			!bytes.Equal(got.Body, resp.Body) || (got.Header == nil) != (resp.Header == nil) ||
			len(got.Header) != len(resp.Header) || got.Header.Get("Content-Type") != resp.Header.Get("Content-Type") ||
			len(got.Header.Values("X-Many")) != len(resp.Header.Values("X-Many")) {
			t.Errorf("%s: replay = %#v, want %#v", tc.name, got, resp)
		}
		// Trailers come back as they were stored (nil and empty alike
		// mean none).
		if got != nil && !sameHeader(got.Trailer, resp.Trailer) {
			t.Errorf("%s: replayed Trailer = %#v, want %#v", tc.name, got.Trailer, resp.Trailer)
		}
		if rec, err := s.Get(ctx, "", p.Key); err != nil || rec.Response == nil {
			t.Errorf("%s: Get after completion = %+v, %v", tc.name, rec, err)
		} else if !sameHeader(rec.Response.Trailer, resp.Trailer) {
			t.Errorf("%s: Get: Response.Trailer = %#v, want %#v", tc.name, rec.Response.Trailer, resp.Trailer)
		}
	}
}

// sameHeader reports whether a and b hold the same names and values,
// in order; nil and empty are the same.
func sameHeader(a, b http.Header) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || !slices.Equal(v, w) {
			return false
		}
	}
	return true
}

// testCanceledContext: a claim whose context is done fails with the
// context's error and claims nothing.
func testCanceledContext(t *testing.T, h Harness) {
	s := h.New(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := s.Claim(ctx, params("u1", "k-canceled", "fp1")); !errors.Is(err, context.Canceled) {
		t.Errorf("Claim: got %v, want context.Canceled", err)
	}
	if _, err := s.Get(context.Background(), "u1", "k-canceled"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get: got %v, want ErrNotFound", err)
	}
}

// testConcurrentTakeover has many attempts race for keys whose lease ran
// out: for one key exactly one of them takes over; for the other the
// first holder tries to commit meanwhile, and exactly one side wins.
func testConcurrentTakeover(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	p := params("u1", "k-takeover-race", "fp1")
	q := params("u1", "k-takeover-commit", "fp1")
	p.Lease, q.Lease = 50*time.Millisecond, 50*time.Millisecond
	mustLease(t, s, p)
	first := mustLease(t, s, q)
	time.Sleep(100 * time.Millisecond)
	p.Lease, q.Lease = 10*time.Second, 10*time.Second

	// race has n attempts claim c at once while also runs, and counts the
	// leases and the in-flight answers they got.
	const n = 50
	race := func(c idem.ClaimParams, also func()) (leases, inFlight int64) {
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

// clockStart is where the clock of the cases that set one starts.
var clockStart = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// clocked returns a fresh store on a Clock of its own, or skips t when the
// harness cannot set a store's clock.
func clocked(t *testing.T, h Harness) (idem.Store, *Clock) {
	t.Helper()
	if h.NewAt == nil {
		t.Skip("Harness.NewAt is not set: this case needs the store's clock")
	}
	clk := NewClock(clockStart)
	return h.NewAt(t, clk.Now), clk
}

// testClaimTimes: a new key's lease and record carry the claim's time.
func testClaimTimes(t *testing.T, h Harness) {
	s, clk := clocked(t, h)
	now := clk.Now()
	p := params("u1", "k-claim-times", "fp1")
	l := mustLease(t, s, p)
	if l.User != p.User || l.Key != p.Key || l.Owner == "" || l.Attempt != 1 ||
		!l.CreatedAt.Equal(now) || !l.Until.Equal(now.Add(p.Lease)) {
		t.Errorf("lease = %+v, want attempt 1 of u1/%s with an owner, created %v, until %v", l, p.Key, now, now.Add(p.Lease))
	}
	rec, err := s.Get(context.Background(), p.User, p.Key)
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Owner != l.Owner || !rec.LeaseUntil.Equal(l.Until) || rec.Attempts != 1 || rec.Response != nil ||
		!rec.CreatedAt.Equal(now) || !rec.CompletedAt.IsZero() || !rec.ExpiresAt.Equal(now.Add(p.TTL)) {
		t.Errorf("Get = %+v, want the lease's owner and times, created %v, expiring %v", rec, now, now.Add(p.TTL))
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
	if sw, ok := s.(idem.Sweeper); ok {
		if recs, err := sw.Abandoned(ctx, idem.AbandonedParams{Limit: 10}); err != nil || len(recs) != 1 || recs[0].Key != p.Key {
			t.Errorf("Abandoned after Fail = %s, %v; want %s", keys(recs), err, p.Key)
		}
	}
	l2 := mustLease(t, s, p) // at once, the clock unmoved
	if l2.Attempt != 2 || l2.Owner == l.Owner || !l2.Until.Equal(clk.Now().Add(p.Lease)) {
		t.Errorf("retry after Fail = %+v, want attempt 2, a new owner, until %v", l2, clk.Now().Add(p.Lease))
	}
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
	if sw, ok := s.(idem.Sweeper); ok {
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
	sw, ok := s.(idem.Sweeper)
	if !ok {
		t.Skip("store does not implement idem.Sweeper")
	}
	p := params("u1", "k-expired-abandoned", "fp1")
	p.TTL, p.Lease = time.Minute, time.Second
	first := mustLease(t, s, p)
	clk.Advance(2 * p.TTL)
	if recs, err := sw.Abandoned(ctx, idem.AbandonedParams{Limit: 10}); err != nil || keys(recs) != p.Key {
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

// testClaimResend: a Claim sent again with the same Owner, as after an
// answer lost with the connection, gets the lease it took, on a new key
// and on a takeover alike; it is never answered ErrInFlight and the
// attempt is not counted twice.
func testClaimResend(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	p := params("u1", "k-resend", "fp1")
	p.Owner = idem.NewOwner()
	first := mustLease(t, s, p)
	if first.Owner != p.Owner {
		t.Errorf("lease owner = %q, want the caller's %q", first.Owner, p.Owner)
	}
	again := mustLease(t, s, p)
	if *again != *first {
		t.Errorf("resent claim = %+v, want the same lease %+v", again, first)
	}
	other := p
	other.Owner = idem.NewOwner()
	if _, err := s.Claim(ctx, other); !errors.Is(err, idem.ErrInFlight) {
		t.Errorf("another attempt while the lease is live: got %v, want ErrInFlight", err)
	}
	if err := s.Fail(ctx, first); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	taken := mustLease(t, s, other)
	if taken.Owner != other.Owner || taken.Attempt != 2 {
		t.Errorf("takeover = %+v, want owner %q, attempt 2", taken, other.Owner)
	}
	if again := mustLease(t, s, other); *again != *taken {
		t.Errorf("resent takeover = %+v, want the same lease %+v", again, taken)
	}
	if _, err := s.Claim(ctx, p); !errors.Is(err, idem.ErrInFlight) {
		t.Errorf("the first attempt's owner after the takeover: got %v, want ErrInFlight", err)
	}
	if err := run(ctx, h, s, first, "resend-old", response("old")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("the first attempt's Complete: got %v, want ErrFenced", err)
	}
	if err := run(ctx, h, s, taken, "resend", response("done")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	c, err := s.Claim(ctx, other)
	if err != nil {
		t.Fatalf("claim after completion: %v", err)
	}
	sameResponse(t, c.Response, response("done"))
	if rec, err := s.Get(ctx, p.User, p.Key); err != nil || rec.Attempts != 2 {
		t.Errorf("Get = %+v, %v; want 2 attempts", rec, err)
	}
}

// testExpiresIn: Claim reports how long the record has left to live, by
// the store's clock, never more.
func testExpiresIn(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	p := params("u1", "k-expires-in", "fp1")
	p.TTL = time.Hour
	c, err := s.Claim(ctx, p)
	if err != nil || c.Lease == nil {
		t.Fatalf("Claim = %+v, %v; want a lease", c, err)
	}
	if c.ExpiresIn != p.TTL {
		t.Errorf("new key: ExpiresIn = %v, want %v", c.ExpiresIn, p.TTL)
	}
	clk.Advance(10 * time.Second)
	if err := run(ctx, h, s, c.Lease, "expires-in", response("x")); err != nil {
		t.Fatalf("run: %v", err)
	}
	clk.Advance(5 * time.Second)
	c, err = s.Claim(ctx, p)
	if err != nil || c.Response == nil {
		t.Fatalf("replay = %+v, %v", c, err)
	}
	if left := p.TTL - 15*time.Second; c.ExpiresIn < 0 || c.ExpiresIn > left {
		t.Errorf("replay: ExpiresIn = %v, want at most %v (0: unknown)", c.ExpiresIn, left)
	}
}

// testAbandonedOrder: Abandoned lists the requests without an answer whose
// lease ended (run out or failed), expired or not, the longest waiting
// (earliest lease end) first, up to its limit, with what is needed to run
// them again.
func testAbandonedOrder(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	sw, ok := s.(idem.Sweeper)
	if !ok {
		t.Skip("store does not implement idem.Sweeper")
	}
	short := func(key string) idem.ClaimParams {
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

	if recs, err := sw.Abandoned(ctx, idem.AbandonedParams{Limit: 10}); err != nil || keys(recs) != "failed" {
		t.Errorf("Abandoned before the leases ran out = %s, %v; want failed alone", keys(recs), err)
	}
	clk.Advance(2 * time.Second)
	recs, err := sw.Abandoned(ctx, idem.AbandonedParams{Limit: 10})
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
	if recs, err := sw.Abandoned(ctx, idem.AbandonedParams{Limit: 2}); err != nil || keys(recs) != "failed a-oldest" {
		t.Errorf("Abandoned(2) = %s, %v; want the two longest waiting", keys(recs), err)
	}
	if recs, err := sw.Abandoned(ctx, idem.AbandonedParams{Limit: 0}); err != nil || len(recs) != 0 {
		t.Errorf("Abandoned(0) = %s, %v; want none", keys(recs), err)
	}

	// A key retried and failed again has waited least: it comes last.
	again := mustLease(t, s, short("a-oldest"))
	if err := s.Fail(ctx, again); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	if recs, err := sw.Abandoned(ctx, idem.AbandonedParams{Limit: 3}); err != nil || keys(recs) != "failed a-middle expired" {
		t.Errorf("Abandoned(3) after a-oldest failed again = %s, %v; want the keys waiting longer", keys(recs), err)
	}
}

// testRedriveClaim: a completer's claim (ClaimParams.Redrive) takes over
// only the operation it listed, only while it is due, and never inserts
// or replaces a record: completers working from lists made at the same
// moment never skip a backoff or spend another operation's budget.
func testRedriveClaim(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	due := idem.AbandonedParams{MaxRedrives: 2, Backoff: time.Second, MaxBackoff: time.Minute}
	redrive := func(p idem.ClaimParams, created time.Time) (idem.Claim, error) {
		p.Redrive, p.Owner = &idem.RedriveParams{CreatedAt: created, Due: due}, idem.NewOwner()
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
	sw, ok := s.(idem.Sweeper)
	if !ok {
		t.Skip("store does not implement idem.Sweeper")
	}
	redrive := func(p idem.ClaimParams) *idem.Lease {
		t.Helper()
		rec, err := s.Get(ctx, p.User, p.Key)
		if err != nil {
			t.Fatalf("Get: %v", err)
		}
		p.Redrive, p.Owner = &idem.RedriveParams{CreatedAt: rec.CreatedAt}, idem.NewOwner()
		l := mustLease(t, s, p)
		if again := mustLease(t, s, p); *again != *l { // a resend counts nothing
			t.Fatalf("resent re-drive = %+v, want %+v", again, l)
		}
		if err := s.Fail(ctx, l); err != nil {
			t.Fatalf("Fail: %v", err)
		}
		return l
	}
	client := func(p idem.ClaimParams) {
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
	p := idem.AbandonedParams{Limit: 10, MaxRedrives: 2, Backoff: time.Second, MaxBackoff: time.Minute}
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
	if recs, err := sw.Abandoned(ctx, idem.AbandonedParams{Limit: 1}); err != nil || keys(recs) != "k-a" {
		t.Errorf("Abandoned(1) = %s, %v; want k-a", keys(recs), err)
	}
}

// testDeleteExpiredBatches: DeleteExpired deletes expired completed keys up
// to its limit, and never a key without an answer, expired or not, leased,
// failed or abandoned: its attempt may have paid, and the completer must
// still be able to finish it.
func testDeleteExpiredBatches(t *testing.T, h Harness) {
	ctx := context.Background()
	s, clk := clocked(t, h)
	sw, ok := s.(idem.Sweeper)
	if !ok {
		t.Skip("store does not implement idem.Sweeper")
	}
	short := func(key string, ttl, lease time.Duration) idem.ClaimParams {
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

// keys lists the records' keys, space-separated.
func keys(recs []idem.Record) string {
	var b strings.Builder
	for i, r := range recs {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(r.Key)
	}
	return b.String()
}
