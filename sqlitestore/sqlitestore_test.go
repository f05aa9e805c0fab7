package sqlitestore_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/sqlitestore"
	"github.com/idem-go/idem/storetest"
)

const createEffects = `CREATE TABLE storetest_effects (name TEXT NOT NULL)`

func TestConformance(t *testing.T) {
	storetest.Run(t, storetest.Harness{
		New: func(t *testing.T) idem.Store {
			s, _ := setup(t, sqlitestore.Options{})
			return s
		},
		Write: func(ctx context.Context, tx idem.Tx, name string) error {
			_, err := tx.(*sqlitestore.Tx).SQL().ExecContext(ctx, `INSERT INTO storetest_effects (name) VALUES (?)`, name)
			return err
		},
		Count: func(ctx context.Context, s idem.Store, name string) (int, error) {
			return countEffects(ctx, s.(*sqlitestore.Store), name)
		},
	})
}

// clock is a test clock that moves only when told.
type clock struct {
	mu  sync.Mutex // guards now
	now time.Time
}

func newClock() *clock { return &clock{now: time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

type testBundle struct {
	path string // the database file
}

// setup opens a store with opts on a fresh file, with the effects table.
func setup(t *testing.T, opts sqlitestore.Options) (*sqlitestore.Store, *testBundle) {
	t.Helper()
	b := &testBundle{path: filepath.Join(t.TempDir(), "idem.db")}
	s, err := sqlitestore.Open(context.Background(), b.path, opts)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	if _, err := s.DB().Exec(createEffects); err != nil {
		t.Fatalf("creating storetest_effects: %v", err)
	}
	return s, b
}

// setupClock is setup on a test clock.
func setupClock(t *testing.T) (*sqlitestore.Store, *clock) {
	t.Helper()
	clk := newClock()
	s, _ := setup(t, sqlitestore.Options{Now: clk.Now})
	return s, clk
}

func countEffects(ctx context.Context, s *sqlitestore.Store, name string) (int, error) {
	var n int
	err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM storetest_effects WHERE name = ?`, name).Scan(&n)
	return n, err
}

func mustCount(t *testing.T, s *sqlitestore.Store, name string) int {
	t.Helper()
	n, err := countEffects(context.Background(), s, name)
	if err != nil {
		t.Fatalf("counting %q: %v", name, err)
	}
	return n
}

func params(user, key, fp string) idem.ClaimParams {
	return idem.ClaimParams{
		User:        user,
		Key:         key,
		Fingerprint: fp,
		Method:      http.MethodPost,
		Path:        "/v1/orders",
		Header:      http.Header{"Content-Type": {"application/json"}},
		Body:        []byte(`{"n":1}`),
		Lease:       10 * time.Second,
		TTL:         time.Hour,
	}
}

func response(body string) *idem.Response {
	return &idem.Response{
		Status: http.StatusCreated,
		Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/v1/orders/1"}},
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

// run writes effect name through a transaction of l and completes it with resp.
func run(t *testing.T, s *sqlitestore.Store, l *idem.Lease, name string, resp *idem.Response) error {
	t.Helper()
	ctx := context.Background()
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if _, err := tx.(*sqlitestore.Tx).SQL().ExecContext(ctx, `INSERT INTO storetest_effects (name) VALUES (?)`, name); err != nil {
		tx.Rollback(ctx)
		t.Fatalf("write: %v", err)
	}
	return tx.Complete(ctx, resp)
}

func sameResponse(t *testing.T, got, want *idem.Response) {
	t.Helper()
	if got == nil {
		t.Fatalf("got no response, want %d %q", want.Status, want.Body)
	}
	if got.Status != want.Status || !bytes.Equal(got.Body, want.Body) {
		t.Fatalf("got response %d %q, want %d %q", got.Status, got.Body, want.Status, want.Body)
	}
	for k := range want.Header {
		if g, w := got.Header.Get(k), want.Header.Get(k); g != w {
			t.Fatalf("got header %s %q, want %q", k, g, w)
		}
	}
}

func TestClaimAndReplay(t *testing.T) {
	s, clk := setupClock(t)
	ctx := context.Background()
	p := params("u1", "k1", "fp1")
	l := mustLease(t, s, p)
	if l.Attempt != 1 || l.Owner == "" || l.User != "u1" || l.Key != "k1" {
		t.Errorf("lease = %+v, want attempt 1 of u1/k1 with an owner", l)
	}
	if want := clk.Now().Add(p.Lease); !l.Until.Equal(want) {
		t.Errorf("lease Until = %v, want %v", l.Until, want)
	}
	want := response(`{"id":"1"}`)
	if err := run(t, s, l, "replay", want); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	clk.Advance(time.Minute) // past the lease: a completed key stays completed
	for i := range 2 {
		c, err := s.Claim(ctx, p)
		if err != nil {
			t.Fatalf("repeat %d: %v", i, err)
		}
		if c.Lease != nil {
			t.Fatalf("repeat %d: got a lease for a completed key", i)
		}
		sameResponse(t, c.Response, want)
	}
	if got, want := mustCount(t, s, "replay"), 1; got != want {
		t.Errorf("effects = %d, want %d", got, want)
	}
	rec, err := s.Get(ctx, "u1", "k1")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if got, want := rec.CompletedAt, clk.Now().Add(-time.Minute); !got.Equal(want) {
		t.Errorf("CompletedAt = %v, want %v", got, want)
	}
	if got, want := rec.ExpiresAt, rec.CreatedAt.Add(time.Hour); !got.Equal(want) {
		t.Errorf("ExpiresAt = %v, want %v", got, want)
	}
}

func TestRecordRoundTrip(t *testing.T) {
	s, _ := setupClock(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name   string
		header http.Header
		body   []byte
	}{
		{"nil", nil, nil},
		{"empty", http.Header{}, []byte{}},
		{"full", http.Header{"Content-Type": {"application/json"}, "X-Many": {"a", "b"}}, []byte{0, 1, 2, 0xff}},
	} {
		p := params("u1", "rt-"+tc.name, "fp")
		p.Header, p.Body = tc.header, tc.body
		l := mustLease(t, s, p)
		rec, err := s.Get(ctx, "u1", p.Key)
		if err != nil {
			t.Fatalf("%s: Get: %v", tc.name, err)
		}
		if (rec.Body == nil) != (tc.body == nil) || !bytes.Equal(rec.Body, tc.body) {
			t.Errorf("%s: Body = %#v, want %#v", tc.name, rec.Body, tc.body)
		}
		if (rec.Header == nil) != (tc.header == nil) || len(rec.Header) != len(tc.header) {
			t.Errorf("%s: Header = %#v, want %#v", tc.name, rec.Header, tc.header)
		}
		resp := &idem.Response{Status: http.StatusNoContent, Header: tc.header, Body: tc.body}
		if err := run(t, s, l, "rt", resp); err != nil {
			t.Fatalf("%s: Complete: %v", tc.name, err)
		}
		c, err := s.Claim(ctx, p)
		if err != nil {
			t.Fatalf("%s: replay: %v", tc.name, err)
		}
		got := c.Response
		if got == nil || got.Status != resp.Status || (got.Body == nil) != (resp.Body == nil) ||
			!bytes.Equal(got.Body, resp.Body) || (got.Header == nil) != (resp.Header == nil) ||
			got.Header.Get("Content-Type") != resp.Header.Get("Content-Type") ||
			len(got.Header.Values("X-Many")) != len(resp.Header.Values("X-Many")) {
			t.Errorf("%s: replay = %#v, want %#v", tc.name, got, resp)
		}
	}
}

func TestMismatch(t *testing.T) {
	s, _ := setupClock(t)
	ctx := context.Background()
	l := mustLease(t, s, params("u1", "k1", "fp1"))
	if _, err := s.Claim(ctx, params("u1", "k1", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("in flight, other fingerprint: got %v, want ErrFingerprintMismatch", err)
	}
	if err := run(t, s, l, "mismatch", response("a")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if _, err := s.Claim(ctx, params("u1", "k1", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("completed, other fingerprint: got %v, want ErrFingerprintMismatch", err)
	}
}

func TestInFlight(t *testing.T) {
	s, clk := setupClock(t)
	p := params("u1", "k1", "fp1")
	l := mustLease(t, s, p)
	clk.Advance(p.Lease - time.Nanosecond)
	_, err := s.Claim(context.Background(), p)
	var ife *idem.InFlightError
	if !errors.As(err, &ife) || !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("second claim: got %v, want *idem.InFlightError", err)
	}
	if !ife.LeaseUntil.Equal(l.Until) {
		t.Errorf("LeaseUntil = %v, want %v", ife.LeaseUntil, l.Until)
	}
}

func TestTakeover(t *testing.T) {
	s, clk := setupClock(t)
	ctx := context.Background()
	p := params("u1", "k1", "fp1")
	first := mustLease(t, s, p)
	clk.Advance(p.Lease) // the lease runs out at its Until
	second := mustLease(t, s, p)
	if second.Owner == first.Owner || second.Attempt != 2 {
		t.Errorf("takeover: owner %q attempt %d, want a new owner and attempt 2", second.Owner, second.Attempt)
	}
	if !first.CreatedAt.Equal(clk.Now().Add(-p.Lease)) || first.CreatedAt != second.CreatedAt {
		t.Errorf("CreatedAt: first %v, takeover %v; want both %v", first.CreatedAt, second.CreatedAt, clk.Now().Add(-p.Lease))
	}
	rec, err := s.Get(ctx, "u1", "k1")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Owner != second.Owner || rec.Attempts != 2 || !rec.LeaseUntil.Equal(second.Until) {
		t.Errorf("record = owner %q attempts %d lease %v, want %q 2 %v", rec.Owner, rec.Attempts, rec.LeaseUntil, second.Owner, second.Until)
	}

	// The first attempt is fenced off: nothing it wrote commits.
	if err := run(t, s, first, "fenced-first", response("first")); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("first Complete: got %v, want ErrFenced", err)
	}
	if err := run(t, s, first, "fenced-first", nil); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("first Complete(nil): got %v, want ErrFenced", err)
	}
	if err := s.Release(ctx, first); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("first Release: got %v, want ErrFenced", err)
	}
	if err := s.Fail(ctx, first); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("first Fail: got %v, want ErrFenced", err)
	}
	if got := mustCount(t, s, "fenced-first"); got != 0 {
		t.Errorf("fenced effects = %d, want 0", got)
	}
	if err := run(t, s, second, "fenced-second", response("second")); err != nil {
		t.Fatalf("second Complete: %v", err)
	}
	if got := mustCount(t, s, "fenced-second"); got != 1 {
		t.Errorf("owner's effects = %d, want 1", got)
	}
	// A completed key cannot be released, failed or completed again.
	if err := s.Release(ctx, second); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Release after Complete: got %v, want ErrFenced", err)
	}
	if err := s.Fail(ctx, second); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Fail after Complete: got %v, want ErrFenced", err)
	}
	if err := run(t, s, second, "fenced-second", response("again")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("second Complete again: got %v, want ErrFenced", err)
	}
}

func TestTxLifecycle(t *testing.T) {
	s, _ := setupClock(t)
	ctx := context.Background()
	l := mustLease(t, s, params("u1", "k1", "fp1"))

	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("second Rollback: %v, want nil", err)
	}
	if err := tx.Complete(ctx, response("x")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Complete after Rollback: got %v, want ErrFenced", err)
	}

	tx, err = s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if err := tx.Complete(ctx, response("x")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("Rollback after Complete: %v, want nil", err)
	}
	if err := tx.Complete(ctx, response("x")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("second Complete: got %v, want ErrFenced", err)
	}
}

func TestCompleteNilFreesKey(t *testing.T) {
	s, _ := setupClock(t)
	ctx := context.Background()
	l := mustLease(t, s, params("u1", "k1", "fp1"))
	if err := run(t, s, l, "nil", nil); err != nil {
		t.Fatalf("Complete(nil): %v", err)
	}
	if got := mustCount(t, s, "nil"); got != 1 {
		t.Errorf("effects = %d, want 1: the work stands", got)
	}
	if _, err := s.Get(ctx, "u1", "k1"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get: got %v, want ErrNotFound", err)
	}
	if l2 := mustLease(t, s, params("u1", "k1", "fp2")); l2.Attempt != 1 {
		t.Errorf("Attempt after a free = %d, want 1", l2.Attempt)
	}
}

func TestRelease(t *testing.T) {
	s, _ := setupClock(t)
	ctx := context.Background()
	l := mustLease(t, s, params("u1", "k1", "fp1"))
	if err := s.Release(ctx, l); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if _, err := s.Get(ctx, "u1", "k1"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get after Release: got %v, want ErrNotFound", err)
	}
	if err := s.Release(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("second Release: got %v, want ErrFenced", err)
	}
	l2 := mustLease(t, s, params("u1", "k1", "fp2"))
	if l2.Attempt != 1 {
		t.Errorf("Attempt after Release = %d, want 1", l2.Attempt)
	}
	if err := s.Release(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("stale Release: got %v, want ErrFenced", err)
	}
}

func TestFail(t *testing.T) {
	s, clk := setupClock(t)
	ctx := context.Background()
	p := params("u1", "k1", "fp1")
	l := mustLease(t, s, p)
	clk.Advance(time.Second)
	if err := s.Fail(ctx, l); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	rec, err := s.Get(ctx, "u1", "k1")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if !rec.LeaseUntil.Equal(clk.Now()) || rec.Attempts != 1 {
		t.Errorf("after Fail: lease %v attempts %d, want %v and 1", rec.LeaseUntil, rec.Attempts, clk.Now())
	}
	abandoned, err := s.Abandoned(ctx, 10)
	if err != nil || len(abandoned) != 1 {
		t.Errorf("Abandoned after Fail = %d records, %v; want 1", len(abandoned), err)
	}
	if _, err := s.Claim(ctx, params("u1", "k1", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("other body after a failure: got %v, want ErrFingerprintMismatch", err)
	}
	l2 := mustLease(t, s, p)
	if l2.Attempt != 2 || l2.Owner == l.Owner {
		t.Errorf("retry: attempt %d owner %q, want 2 and a new owner", l2.Attempt, l2.Owner)
	}
}

func TestExpiry(t *testing.T) {
	s, clk := setupClock(t)
	ctx := context.Background()
	p := params("u1", "k1", "fp1")
	p.TTL = time.Minute
	l := mustLease(t, s, p)
	if err := run(t, s, l, "expiry", response("old")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	clk.Advance(time.Minute - time.Nanosecond)
	if _, err := s.Get(ctx, "u1", "k1"); err != nil {
		t.Fatalf("Get just before expiry: %v", err)
	}
	clk.Advance(time.Nanosecond)
	if _, err := s.Get(ctx, "u1", "k1"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get at expiry: got %v, want ErrNotFound", err)
	}
	p2 := params("u1", "k1", "fp2")
	l2 := mustLease(t, s, p2)
	if l2.Attempt != 1 || !l2.CreatedAt.Equal(clk.Now()) || l2.CreatedAt.Equal(l.CreatedAt) {
		t.Errorf("lease after expiry: attempt %d created %v, want 1 and %v", l2.Attempt, l2.CreatedAt, clk.Now())
	}
	rec, err := s.Get(ctx, "u1", "k1")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Response != nil || !rec.CompletedAt.IsZero() || rec.Fingerprint != "fp2" || !rec.CreatedAt.Equal(clk.Now()) {
		t.Errorf("record after expiry = %+v, want a fresh one for fp2", rec)
	}
	if err := run(t, s, l2, "expiry", response("new")); err != nil {
		t.Fatalf("Complete after expiry: %v", err)
	}
	c, err := s.Claim(ctx, p2)
	if err != nil {
		t.Fatalf("replay: %v", err)
	}
	sameResponse(t, c.Response, response("new"))
}

// An expired key starts over even while an attempt still holds it, as in
// memstore; the old attempt is fenced off.
func TestExpiryWhileLeased(t *testing.T) {
	s, clk := setupClock(t)
	p := params("u1", "k1", "fp1")
	p.TTL = time.Second
	old := mustLease(t, s, p)
	clk.Advance(time.Second)
	fresh := mustLease(t, s, p)
	if fresh.Attempt != 1 || fresh.Owner == old.Owner {
		t.Errorf("claim after expiry: %+v, want a fresh lease", fresh)
	}
	if err := run(t, s, old, "old", response("old")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("old Complete: got %v, want ErrFenced", err)
	}
}

func TestUserScope(t *testing.T) {
	s, _ := setupClock(t)
	ctx := context.Background()
	a := mustLease(t, s, params("alice", "shared", "fp-a"))
	b := mustLease(t, s, params("bob", "shared", "fp-b"))
	if err := run(t, s, a, "alice", response("alice")); err != nil {
		t.Fatalf("alice: %v", err)
	}
	if err := run(t, s, b, "bob", response("bob")); err != nil {
		t.Fatalf("bob: %v", err)
	}
	for _, user := range []string{"alice", "bob"} {
		c, err := s.Claim(ctx, params(user, "shared", "fp-"+user[:1]))
		if err != nil {
			t.Fatalf("%s replay: %v", user, err)
		}
		sameResponse(t, c.Response, response(user))
	}
	// Bob's lease cannot touch Alice's key.
	b.User = "alice"
	if err := s.Release(ctx, b); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Release of another user's key: got %v, want ErrFenced", err)
	}
}

func TestConcurrentClaims(t *testing.T) {
	s, _ := setup(t, sqlitestore.Options{})
	p := params("u1", "race", "fp1")
	const n = 50
	var leases, inflight atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range n {
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
				t.Errorf("Claim: %+v, %v", c, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if got, want := leases.Load(), int64(1); got != want {
		t.Errorf("leases = %d, want %d", got, want)
	}
	if got, want := inflight.Load(), int64(n-1); got != want {
		t.Errorf("in flight = %d, want %d", got, want)
	}
}

// TestConcurrentTakeover has many attempts race for a key whose lease ran
// out, while its first holder tries to commit: exactly one of them wins.
func TestConcurrentTakeover(t *testing.T) {
	s, _ := setup(t, sqlitestore.Options{})
	ctx := context.Background()
	p := params("u1", "takeover", "fp1")
	p.Lease = 20 * time.Millisecond
	first := mustLease(t, s, p)
	time.Sleep(30 * time.Millisecond)
	p.Lease = 10 * time.Second
	const n = 50
	var leases atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			c, err := s.Claim(ctx, p)
			switch {
			case err == nil && c.Lease != nil:
				leases.Add(1)
			case err == nil && c.Response != nil, errors.Is(err, idem.ErrInFlight):
			default:
				t.Errorf("Claim: %+v, %v", c, err)
			}
		}()
	}
	close(start)
	err := run(t, s, first, "first", response("first"))
	wg.Wait()
	switch {
	case err == nil:
		if got := leases.Load(); got != 0 {
			t.Errorf("first committed, yet %d takeovers", got)
		}
	case errors.Is(err, idem.ErrFenced):
		if got := leases.Load(); got != 1 {
			t.Errorf("first fenced, takeovers = %d, want 1", got)
		}
	default:
		t.Fatalf("first Complete: %v", err)
	}
}

func TestAbandoned(t *testing.T) {
	s, clk := setupClock(t)
	ctx := context.Background()
	short := func(key string) idem.ClaimParams {
		p := params("u1", key, "fp1")
		p.Lease = time.Second
		return p
	}
	mustLease(t, s, short("a-oldest"))
	clk.Advance(time.Millisecond)
	mustLease(t, s, short("a-middle"))
	clk.Advance(time.Millisecond)
	done := mustLease(t, s, short("done"))
	if err := run(t, s, done, "done", response("done")); err != nil {
		t.Fatal(err)
	}
	exp := short("expired")
	exp.TTL = time.Second
	mustLease(t, s, exp)
	clk.Advance(time.Millisecond)
	mustLease(t, s, short("a-newest"))
	clk.Advance(time.Millisecond)
	mustLease(t, s, params("u1", "live", "fp1")) // 10s lease
	clk.Advance(2 * time.Second)

	recs, err := s.Abandoned(ctx, 10)
	if err != nil {
		t.Fatalf("Abandoned: %v", err)
	}
	var got []string
	for _, r := range recs {
		got = append(got, r.Key)
	}
	if want := "a-oldest a-middle a-newest"; strings.Join(got, " ") != want {
		t.Errorf("Abandoned = %q, want %q", got, want)
	}
	if len(recs) > 0 && (recs[0].Method != http.MethodPost || !bytes.Equal(recs[0].Body, []byte(`{"n":1}`)) ||
		recs[0].Header.Get("Content-Type") != "application/json") {
		t.Errorf("Abandoned[0] = %+v, want the stored request", recs[0])
	}
	recs, err = s.Abandoned(ctx, 2)
	if err != nil || len(recs) != 2 || recs[1].Key != "a-middle" {
		t.Errorf("Abandoned(2) = %+v, %v; want the two oldest", recs, err)
	}
	if recs, err := s.Abandoned(ctx, 0); err != nil || len(recs) != 0 {
		t.Errorf("Abandoned(0) = %+v, %v; want none", recs, err)
	}
}

func TestDeleteExpired(t *testing.T) {
	s, clk := setupClock(t)
	ctx := context.Background()
	ttl := func(key string, ttl, lease time.Duration) idem.ClaimParams {
		p := params("u1", key, "fp1")
		p.TTL, p.Lease = ttl, lease
		return p
	}
	for _, k := range []string{"e1", "e2", "e3"} {
		l := mustLease(t, s, ttl(k, time.Second, time.Second))
		if err := run(t, s, l, k, response(k)); err != nil {
			t.Fatal(err)
		}
	}
	mustLease(t, s, ttl("expired-abandoned", time.Second, time.Second))
	leased := mustLease(t, s, ttl("expired-leased", time.Second, time.Hour))
	mustLease(t, s, ttl("alive", time.Hour, time.Second))
	clk.Advance(2 * time.Second)

	n, err := s.DeleteExpired(ctx, 2)
	if err != nil || n != 2 {
		t.Fatalf("DeleteExpired(2) = %d, %v; want 2", n, err)
	}
	n, err = s.DeleteExpired(ctx, 10)
	if err != nil || n != 2 {
		t.Fatalf("DeleteExpired(10) = %d, %v; want 2", n, err)
	}
	if n, err := s.DeleteExpired(ctx, 10); err != nil || n != 0 {
		t.Fatalf("DeleteExpired again = %d, %v; want 0", n, err)
	}
	var left []string
	rows, err := s.DB().QueryContext(ctx, `SELECT key FROM idempotency_keys ORDER BY key`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			t.Fatal(err)
		}
		left = append(left, k)
	}
	if want := "alive expired-leased"; strings.Join(left, " ") != want {
		t.Errorf("rows left = %q, want %q", left, want)
	}
	// Once its lease ends, the leased expired key goes too.
	if err := s.Fail(ctx, leased); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	if n, err := s.DeleteExpired(ctx, 10); err != nil || n != 1 {
		t.Errorf("DeleteExpired after Fail = %d, %v; want 1", n, err)
	}
}

func TestCanceledContext(t *testing.T) {
	s, _ := setupClock(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := s.Claim(ctx, params("u1", "k1", "fp1")); !errors.Is(err, context.Canceled) {
		t.Errorf("Claim: got %v, want context.Canceled", err)
	}
	if _, err := s.Get(context.Background(), "u1", "k1"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get: got %v, want ErrNotFound", err)
	}
}

// TestMiddleware runs the store behind idem.Middleware, the handler writing
// through FromContext.
func TestMiddleware(t *testing.T) {
	s, _ := setup(t, sqlitestore.Options{})
	var runs atomic.Int64
	h := idem.Middleware(s, idem.Options{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		tx, err := sqlitestore.FromContext(r.Context())
		if err != nil {
			t.Errorf("FromContext: %v", err)
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO storetest_effects (name) VALUES ('order')`); err != nil {
			t.Errorf("insert: %v", err)
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/v1/orders/1")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{"id":"1"}`))
	}))
	send := func() *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodPost, "/v1/orders", strings.NewReader(`{"a": 1}`))
		r.Header.Set("Idempotency-Key", "abc")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	first, second := send(), send()
	if first.Code != http.StatusCreated || second.Code != http.StatusCreated {
		t.Fatalf("statuses = %d, %d; want 201, 201", first.Code, second.Code)
	}
	if got := second.Header().Get("Idempotent-Replayed"); got != "true" {
		t.Errorf("replay Idempotent-Replayed = %q, want true", got)
	}
	if got, want := second.Body.String(), first.Body.String(); got != want {
		t.Errorf("replayed body = %q, want %q", got, want)
	}
	if got := second.Header().Get("Location"); got != "/v1/orders/1" {
		t.Errorf("replayed Location = %q, want /v1/orders/1", got)
	}
	if got := runs.Load(); got != 1 {
		t.Errorf("handler runs = %d, want 1", got)
	}
	if got := mustCount(t, s, "order"); got != 1 {
		t.Errorf("orders = %d, want 1", got)
	}
	if _, err := sqlitestore.FromContext(context.Background()); !errors.Is(err, idem.ErrNoTx) {
		t.Errorf("FromContext outside a request: got %v, want ErrNoTx", err)
	}
}

func TestOpenPragmas(t *testing.T) {
	s, b := setup(t, sqlitestore.Options{})
	ctx := context.Background()
	// Check several pooled connections at once, so that more than one is open.
	conns := make([]*sql.Conn, 3)
	for i := range conns {
		c, err := s.DB().Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		conns[i] = c
	}
	for i, c := range conns {
		var mode string
		var fk, busy, sync int
		if err := c.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&mode); err != nil {
			t.Fatal(err)
		}
		if err := c.QueryRowContext(ctx, `PRAGMA foreign_keys`).Scan(&fk); err != nil {
			t.Fatal(err)
		}
		if err := c.QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&busy); err != nil {
			t.Fatal(err)
		}
		if err := c.QueryRowContext(ctx, `PRAGMA synchronous`).Scan(&sync); err != nil {
			t.Fatal(err)
		}
		if mode != "wal" || fk != 1 || busy != 10000 || sync != 2 {
			t.Errorf("conn %d: journal_mode %q foreign_keys %d busy_timeout %d synchronous %d; want wal 1 10000 2",
				i, mode, fk, busy, sync)
		}
	}

	// Begin takes the write lock at once (BEGIN IMMEDIATE): another
	// connection that will not wait cannot start a write transaction.
	tx, err := s.Begin(ctx, &idem.Lease{})
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	other, err := sql.Open("sqlite", b.path+"?_pragma=busy_timeout(0)")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if _, err := other.ExecContext(ctx, `BEGIN IMMEDIATE`); err == nil || !strings.Contains(err.Error(), "SQLITE_BUSY") {
		t.Errorf("BEGIN IMMEDIATE beside an open Tx: got %v, want SQLITE_BUSY", err)
		other.ExecContext(ctx, `ROLLBACK`)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
}

func TestOpenRefusesMemory(t *testing.T) {
	for _, path := range []string{"", ":memory:", "file:x?mode=memory"} {
		if s, err := sqlitestore.Open(context.Background(), path, sqlitestore.Options{}); err == nil {
			s.Close()
			t.Errorf("Open(%q): got nil error, want one", path)
		}
	}
}

func TestReopen(t *testing.T) {
	s, b := setup(t, sqlitestore.Options{})
	ctx := context.Background()
	l := mustLease(t, s, params("u1", "k1", "fp1"))
	if err := run(t, s, l, "reopen", response("kept")); err != nil {
		t.Fatal(err)
	}
	s2, err := sqlitestore.Open(ctx, b.path, sqlitestore.Options{})
	if err != nil {
		t.Fatalf("second Open: %v", err)
	}
	defer s2.Close()
	c, err := s2.Claim(ctx, params("u1", "k1", "fp1"))
	if err != nil {
		t.Fatalf("Claim through the second store: %v", err)
	}
	sameResponse(t, c.Response, response("kept"))
}

func TestApplyMigrations(t *testing.T) {
	s, b := setup(t, sqlitestore.Options{})
	ctx := context.Background()
	fsys := fstest.MapFS{
		"0002_add_total.sql":  {Data: []byte(`ALTER TABLE orders ADD COLUMN total INTEGER NOT NULL DEFAULT 0;`)},
		"0001_orders.sql":     {Data: []byte("CREATE TABLE orders (id TEXT PRIMARY KEY);\nCREATE INDEX orders_id ON orders (id);")},
		"0010_seed.sql":       {Data: []byte(`INSERT INTO orders (id, total) VALUES ('seed', 1);`)},
		"README.md":           {Data: []byte("not a migration")},
		"notes/0003_skip.sql": {Data: []byte("this is not SQL")},
	}
	// Several handles on the file migrate at once, as instances starting
	// together would; each migration runs once.
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			db, err := sql.Open("sqlite", b.path+"?_pragma=busy_timeout(10000)")
			if err != nil {
				t.Error(err)
				return
			}
			defer db.Close()
			if err := sqlitestore.ApplyMigrations(ctx, db, "orders", fsys); err != nil {
				t.Errorf("ApplyMigrations: %v", err)
			}
		}()
	}
	wg.Wait()
	if err := sqlitestore.ApplyMigrations(ctx, s.DB(), "orders", fsys); err != nil {
		t.Fatalf("ApplyMigrations again: %v", err)
	}
	var seeds int
	if err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM orders WHERE total = 1`).Scan(&seeds); err != nil {
		t.Fatal(err)
	}
	if seeds != 1 {
		t.Errorf("seed rows = %d, want 1", seeds)
	}
	var versions string
	err := s.DB().QueryRowContext(ctx,
		`SELECT group_concat(component || ':' || version, ' ') FROM (SELECT * FROM schema_migrations ORDER BY component, version)`).Scan(&versions)
	if err != nil {
		t.Fatal(err)
	}
	if want := "idem:1 orders:1 orders:2 orders:10"; versions != want {
		t.Errorf("schema_migrations = %q, want %q", versions, want)
	}

	dup := fstest.MapFS{"0001_a.sql": {Data: []byte("SELECT 1")}, "01_b.sql": {Data: []byte("SELECT 1")}}
	if err := sqlitestore.ApplyMigrations(ctx, s.DB(), "dup", dup); err == nil {
		t.Errorf("duplicate versions: got nil error, want one")
	}
	bad := fstest.MapFS{"0001_bad.sql": {Data: []byte("CREATE TABLE good (x); THIS IS NOT SQL;")}}
	if err := sqlitestore.ApplyMigrations(ctx, s.DB(), "bad", bad); err == nil {
		t.Errorf("bad SQL: got nil error, want one")
	}
	var n int
	if err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM schema_migrations WHERE component = 'bad'`).Scan(&n); err != nil || n != 0 {
		t.Errorf("failed migration recorded: %d rows, %v; want 0", n, err)
	}
	if err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM sqlite_schema WHERE name = 'good'`).Scan(&n); err != nil || n != 0 {
		t.Errorf("failed migration left its table: %d, %v; want 0", n, err)
	}
}

// TestTwoStoresOneFile has two stores on one file, as two processes would
// be, race for one key: SQLite's lock, taken by BEGIN IMMEDIATE, decides.
func TestTwoStoresOneFile(t *testing.T) {
	s1, b := setup(t, sqlitestore.Options{})
	s2, err := sqlitestore.Open(context.Background(), b.path, sqlitestore.Options{})
	if err != nil {
		t.Fatalf("second Open: %v", err)
	}
	defer s2.Close()
	p := params("u1", "race", "fp1")
	const n = 40
	var leases, inflight atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		s := s1
		if i%2 == 1 {
			s = s2
		}
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
				t.Errorf("Claim: %+v, %v", c, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if got, want := leases.Load(), int64(1); got != want {
		t.Errorf("leases = %d, want %d", got, want)
	}
	if got, want := inflight.Load(), int64(n-1); got != want {
		t.Errorf("in flight = %d, want %d", got, want)
	}
}

// TestWriteLockWait checks that writers wait for an open Tx, up to the busy
// timeout or their context, and go on once it ends.
func TestWriteLockWait(t *testing.T) {
	s, _ := setup(t, sqlitestore.Options{BusyTimeout: 100 * time.Millisecond})
	ctx := context.Background()
	l := mustLease(t, s, params("u1", "k1", "fp1"))
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if _, err := s.Claim(ctx, params("u1", "k2", "fp1")); !errors.Is(err, sqlitestore.ErrBusy) {
		t.Errorf("Claim beside an open Tx: got %v, want ErrBusy", err)
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
	defer cancel()
	if err := s.Fail(cctx, l); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Fail with a short context: got %v, want DeadlineExceeded", err)
	}
	// Reads do not wait.
	if _, err := s.Get(ctx, "u1", "k1"); err != nil {
		t.Errorf("Get beside an open Tx: %v", err)
	}
	done := make(chan error)
	go func() {
		_, err := s.Claim(ctx, params("u1", "k3", "fp1"))
		done <- err
	}()
	time.Sleep(20 * time.Millisecond)
	if err := tx.Complete(ctx, response("ok")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if err := <-done; err != nil {
		t.Errorf("Claim waiting for the Tx: %v", err)
	}
}
