package storetest

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

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
					time.Sleep(2 * time.Millisecond) // a retrying client's pause between polls; the loop ends at the first answer
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
				if err := responseDiff(c.Response, want); err != nil {
					t.Error(err)
				}
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

// testCompleteDropsRequestBody: the request body is kept while the key
// may be run again (for the completer), and dropped when its answer is
// stored: a replay goes by the fingerprint, and a user's completed keys
// must not keep up to a request body each for their whole TTL.
func testCompleteDropsRequestBody(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	p := params("u1", "k-body", "fp1")
	p.Body = bytes.Repeat([]byte("b"), 4096)
	l := mustLease(t, s, p)
	if err := run(ctx, h, s, l, "body", response(`{"id":1}`)); err != nil {
		t.Fatal(err)
	}
	rec, err := s.Get(ctx, "u1", "k-body")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Response == nil || len(rec.Body) != 0 || rec.Fingerprint != "fp1" || rec.Method != p.Method || rec.Path != p.Path {
		t.Errorf("completed record: response %v, body %d bytes, fingerprint %q, %s %s; want the answer, no body, the request's fingerprint, method and path",
			rec.Response != nil, len(rec.Body), rec.Fingerprint, rec.Method, rec.Path)
	}
	// A replay still answers, and a different body is still refused.
	c, err := s.Claim(ctx, p)
	if err != nil || c.Response == nil || string(c.Response.Body) != `{"id":1}` {
		t.Errorf("replay after the body was dropped: %+v, %v", c, err)
	}
	q := p
	q.Owner, q.Fingerprint = idemdriver.NewOwner(), "fp2"
	if _, err := s.Claim(ctx, q); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Errorf("another request with the key: %v, want ErrFingerprintMismatch", err)
	}
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
		resp := &idemdriver.Response{Status: http.StatusNoContent, Header: tc.header, Body: tc.body, Trailer: tc.trailer}
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

// testClaimResend: a Claim sent again with the same Owner, as after an
// answer lost with the connection, gets the lease it took, on a new key
// and on a takeover alike; it is never answered ErrInFlight and the
// attempt is not counted twice.
func testClaimResend(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	p := params("u1", "k-resend", "fp1")
	p.Owner = idemdriver.NewOwner()
	first := mustLease(t, s, p)
	if first.Owner != p.Owner {
		t.Errorf("lease owner = %q, want the caller's %q", first.Owner, p.Owner)
	}
	again := mustLease(t, s, p)
	if *again != *first {
		t.Errorf("resent claim = %+v, want the same lease %+v", again, first)
	}
	other := p
	other.Owner = idemdriver.NewOwner()
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
