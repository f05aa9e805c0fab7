package pgstore_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
)

func params(user, key, fp string) idem.ClaimParams {
	return idem.ClaimParams{
		User:        user,
		Key:         key,
		Fingerprint: fp,
		Method:      http.MethodPost,
		Path:        "/v1/orders",
		Header:      http.Header{"Content-Type": {"application/json"}},
		Body:        []byte(`{"items":[]}`),
		Lease:       30 * time.Second,
		TTL:         24 * time.Hour,
	}
}

func response(body string) *idem.Response {
	return &idem.Response{
		Status: http.StatusCreated,
		Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/v1/orders/1"}},
		Body:   []byte(body),
	}
}

func mustLease(t *testing.T, s *pgstore.Store, p idem.ClaimParams) *idem.Lease {
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

// write inserts an effect through the request's transaction, as a handler
// would.
func write(t *testing.T, tx idem.Tx, name string) {
	t.Helper()
	if _, err := tx.(*pgstore.Tx).PgxTx().Exec(context.Background(), `INSERT INTO effects (name) VALUES ($1)`, name); err != nil {
		t.Fatalf("writing effect %q: %v", name, err)
	}
}

func effects(t *testing.T, b *testBundle, name string) int {
	t.Helper()
	var n int
	if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM effects WHERE name = $1`, name).Scan(&n); err != nil {
		t.Fatalf("counting effects: %v", err)
	}
	return n
}

// complete runs a handler under l that writes name and answers resp.
func complete(t *testing.T, s *pgstore.Store, l *idem.Lease, name string, resp *idem.Response) error {
	t.Helper()
	ctx := context.Background()
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	write(t, tx, name)
	return tx.Complete(ctx, resp)
}

func TestClaimNewKey(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	p := params("u1", "k1", "fp1")
	l := mustLease(t, s, p)
	if l.User != "u1" || l.Key != "k1" || l.Owner == "" || l.Attempt != 1 || !l.CreatedAt.Equal(b.clock.Now()) {
		t.Errorf("lease = %+v, want u1/k1, an owner, attempt 1, created now", l)
	}
	if want := b.clock.Now().Add(p.Lease); !l.Until.Equal(want) {
		t.Errorf("lease until %v, want %v", l.Until, want)
	}
	rec, err := s.Get(context.Background(), "u1", "k1")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	now := b.clock.Now()
	if rec.Fingerprint != "fp1" || rec.Method != p.Method || rec.Path != p.Path ||
		!bytes.Equal(rec.Body, p.Body) || rec.Header.Get("Content-Type") != "application/json" ||
		rec.Owner != l.Owner || !rec.LeaseUntil.Equal(l.Until) || rec.Attempts != 1 ||
		rec.Response != nil || !rec.CreatedAt.Equal(now) || !rec.CompletedAt.IsZero() ||
		!rec.ExpiresAt.Equal(now.Add(p.TTL)) {
		t.Errorf("Get = %+v, want the claimed request", rec)
	}
}

func TestReplay(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	p := params("u1", "k1", "fp1")
	l := mustLease(t, s, p)
	want := response(`{"id":"1"}`)
	if err := complete(t, s, l, "replay", want); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	b.clock.Advance(time.Hour) // long after the lease: still a replay
	for i := range 3 {
		c, err := s.Claim(ctx, p)
		if err != nil {
			t.Fatalf("repeat %d: %v", i, err)
		}
		if c.Lease != nil || c.Response == nil {
			t.Fatalf("repeat %d: got %+v, want a response", i, c)
		}
		if got := c.Response; got.Status != want.Status || !bytes.Equal(got.Body, want.Body) ||
			got.Header.Get("Location") != "/v1/orders/1" || got.Header.Get("Content-Type") != "application/json" {
			t.Errorf("repeat %d: got %d %v %q, want %d %v %q", i, got.Status, got.Header, got.Body, want.Status, want.Header, want.Body)
		}
	}
	if got := effects(t, b, "replay"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
	rec, err := s.Get(ctx, "u1", "k1")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Response == nil || !rec.CompletedAt.Equal(b.clock.Now().Add(-time.Hour)) {
		t.Errorf("Get = %+v, want completed at the time of Complete", rec)
	}
}

func TestMismatch(t *testing.T) {
	t.Parallel()
	s, _ := setup(t)
	ctx := context.Background()
	l := mustLease(t, s, params("u1", "k1", "fp1"))
	// The fingerprint is checked before the lease: another body is a
	// mismatch even while the first runs.
	if _, err := s.Claim(ctx, params("u1", "k1", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("in flight: got %v, want ErrFingerprintMismatch", err)
	}
	if err := complete(t, s, l, "m", response("a")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if _, err := s.Claim(ctx, params("u1", "k1", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Fatalf("completed: got %v, want ErrFingerprintMismatch", err)
	}
}

func TestInFlight(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	p := params("u1", "k1", "fp1")
	l := mustLease(t, s, p)
	b.clock.Advance(p.Lease - time.Microsecond)
	_, err := s.Claim(context.Background(), p)
	var ife *idem.InFlightError
	if !errors.As(err, &ife) || !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("second claim: got %v, want *InFlightError", err)
	}
	if !ife.LeaseUntil.Equal(l.Until) {
		t.Errorf("LeaseUntil = %v, want %v", ife.LeaseUntil, l.Until)
	}
}

func TestTakeoverAfterLease(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	p := params("u1", "k1", "fp1")
	p.Lease = time.Second
	first := mustLease(t, s, p)
	b.clock.Advance(time.Second) // the lease ends at its Until
	second := mustLease(t, s, p)
	if second.Owner == first.Owner || second.Attempt != 2 || !second.CreatedAt.Equal(first.CreatedAt) {
		t.Errorf("takeover = %+v, want a new owner, attempt 2 and the first lease's CreatedAt", second)
	}
	if want := b.clock.Now().Add(time.Second); !second.Until.Equal(want) {
		t.Errorf("takeover lease until %v, want %v", second.Until, want)
	}
	if _, err := s.Claim(context.Background(), p); !errors.Is(err, idem.ErrInFlight) {
		t.Errorf("claim after takeover: got %v, want ErrInFlight", err)
	}
}

func TestFencedCompleteCommitsNothing(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	p := params("u1", "k1", "fp1")
	p.Lease = time.Second
	slow := mustLease(t, s, p)
	tx, err := s.Begin(ctx, slow)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	write(t, tx, "slow")

	b.clock.Advance(2 * time.Second)
	fast := mustLease(t, s, p) // takes over while slow's transaction is open

	if err := tx.Complete(ctx, response("slow")); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("slow Complete: got %v, want ErrFenced", err)
	}
	if got := effects(t, b, "slow"); got != 0 {
		t.Errorf("fenced attempt's effects = %d, want 0", got)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("Rollback after Complete: %v", err)
	}
	for name, f := range map[string]func(context.Context, *idem.Lease) error{"Release": s.Release, "Fail": s.Fail} {
		if err := f(ctx, slow); !errors.Is(err, idem.ErrFenced) {
			t.Errorf("slow %s: got %v, want ErrFenced", name, err)
		}
	}
	if err := complete(t, s, fast, "fast", response("fast")); err != nil {
		t.Fatalf("fast Complete: %v", err)
	}
	if got := effects(t, b, "fast"); got != 1 {
		t.Errorf("owner's effects = %d, want 1", got)
	}
	c, err := s.Claim(ctx, p)
	if err != nil || c.Response == nil || string(c.Response.Body) != "fast" {
		t.Errorf("replay: got %+v, %v; want the fast response", c, err)
	}
}

func TestCompleteTwice(t *testing.T) {
	t.Parallel()
	s, _ := setup(t)
	ctx := context.Background()
	l := mustLease(t, s, params("u1", "k1", "fp1"))
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if err := tx.Complete(ctx, response("a")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if err := tx.Complete(ctx, response("b")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("second Complete: got %v, want ErrFenced", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("Rollback after Complete: %v", err)
	}
	// A completed record is no longer the lease's: the fence holds.
	if err := s.Release(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Release after Complete: got %v, want ErrFenced", err)
	}
}

func TestCompleteNilFreesKey(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	l := mustLease(t, s, params("u1", "k1", "fp1"))
	if err := complete(t, s, l, "nil", nil); err != nil {
		t.Fatalf("Complete(nil): %v", err)
	}
	if got := effects(t, b, "nil"); got != 1 {
		t.Errorf("effects = %d, want 1: the work stands", got)
	}
	if _, err := s.Get(ctx, "u1", "k1"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get: got %v, want ErrNotFound", err)
	}
}

func TestRollback(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	l := mustLease(t, s, params("u1", "k1", "fp1"))
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	write(t, tx, "rb")
	for range 2 {
		if err := tx.Rollback(ctx); err != nil {
			t.Fatalf("Rollback: %v", err)
		}
	}
	if err := tx.Complete(ctx, response("x")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("Complete after Rollback: got %v, want ErrFenced", err)
	}
	if got := effects(t, b, "rb"); got != 0 {
		t.Errorf("effects = %d, want 0", got)
	}
}

func TestRelease(t *testing.T) {
	t.Parallel()
	s, _ := setup(t)
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
	// A corrected request may reuse the key.
	if l2 := mustLease(t, s, params("u1", "k1", "fp2")); l2.Attempt != 1 {
		t.Errorf("Attempt after Release = %d, want 1", l2.Attempt)
	}
}

func TestFail(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	p := params("u1", "k1", "fp1")
	l := mustLease(t, s, p)
	if err := s.Fail(ctx, l); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	rec, err := s.Get(ctx, "u1", "k1")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if !rec.LeaseUntil.Equal(b.clock.Now()) || rec.Attempts != 1 {
		t.Errorf("after Fail: lease until %v attempts %d, want %v and 1", rec.LeaseUntil, rec.Attempts, b.clock.Now())
	}
	if _, err := s.Claim(ctx, params("u1", "k1", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Errorf("other body after Fail: got %v, want ErrFingerprintMismatch", err)
	}
	l2 := mustLease(t, s, p) // at once, no clock change
	if l2.Attempt != 2 || l2.Owner == l.Owner {
		t.Errorf("retry after Fail = %+v, want attempt 2 and a new owner", l2)
	}
	if err := s.Fail(ctx, l); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("stale Fail: got %v, want ErrFenced", err)
	}
}

func TestExpiry(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	p := params("u1", "k1", "fp1")
	p.TTL = time.Hour
	l := mustLease(t, s, p)
	if err := complete(t, s, l, "old", response("old")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	b.clock.Advance(time.Hour - time.Microsecond)
	if _, err := s.Get(ctx, "u1", "k1"); err != nil {
		t.Errorf("Get just before expiry: %v", err)
	}
	b.clock.Advance(time.Microsecond)
	if _, err := s.Get(ctx, "u1", "k1"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get at expiry: got %v, want ErrNotFound", err)
	}
	// The same key starts a new operation, whatever its body.
	p2 := params("u1", "k1", "fp2")
	l2 := mustLease(t, s, p2)
	if l2.Attempt != 1 || !l2.CreatedAt.Equal(b.clock.Now()) {
		t.Errorf("lease after expiry = %+v, want attempt 1, created now", l2)
	}
	rec, err := s.Get(ctx, "u1", "k1")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Fingerprint != "fp2" || rec.Response != nil || !rec.CompletedAt.IsZero() ||
		!rec.CreatedAt.Equal(b.clock.Now()) || !rec.ExpiresAt.Equal(b.clock.Now().Add(p2.TTL)) {
		t.Errorf("record after expiry = %+v, want a fresh one", rec)
	}
	if err := complete(t, s, l, "stale", response("stale")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("the expired record's lease: got %v, want ErrFenced", err)
	}
}

func TestExpiredLeasedRecordIsReplaced(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	p := params("u1", "k1", "fp1")
	p.TTL = time.Second
	p.Lease = time.Minute
	first := mustLease(t, s, p)
	b.clock.Advance(2 * time.Second) // expired, lease still live: as memstore, a new operation
	second := mustLease(t, s, params("u1", "k1", "fp2"))
	if second.Attempt != 1 || second.Owner == first.Owner {
		t.Errorf("lease = %+v, want a fresh one", second)
	}
}

func TestUserScope(t *testing.T) {
	t.Parallel()
	s, _ := setup(t)
	ctx := context.Background()
	a := mustLease(t, s, params("alice", "k1", "fp-a"))
	if err := complete(t, s, a, "alice", response("alice")); err != nil {
		t.Fatalf("alice: %v", err)
	}
	b := mustLease(t, s, params("bob", "k1", "fp-b")) // same key, other fingerprint: no mismatch
	if err := complete(t, s, b, "bob", response("bob")); err != nil {
		t.Fatalf("bob: %v", err)
	}
	for _, user := range []string{"alice", "bob"} {
		c, err := s.Claim(ctx, params(user, "k1", "fp-"+user[:1]))
		if err != nil || c.Response == nil || string(c.Response.Body) != user {
			t.Errorf("%s replay: got %+v, %v", user, c, err)
		}
		rec, err := s.Get(ctx, user, "k1")
		if err != nil || rec.User != user || string(rec.Response.Body) != user {
			t.Errorf("%s Get: got %+v, %v", user, rec, err)
		}
	}
}

func TestConcurrentClaimsOneLease(t *testing.T) {
	t.Parallel()
	s, _ := setup(t)
	p := params("u1", "k1", "fp1")
	const n = 100
	var leases, inFlight atomic.Int64
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
				inFlight.Add(1)
			default:
				t.Errorf("Claim: %+v, %v", c, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if leases.Load() != 1 || inFlight.Load() != n-1 {
		t.Errorf("leases = %d, in flight = %d; want 1 and %d", leases.Load(), inFlight.Load(), n-1)
	}
}

func TestConcurrentTakeoversOneLease(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	p := params("u1", "k1", "fp1")
	p.Lease = time.Second
	mustLease(t, s, p)
	b.clock.Advance(time.Second)
	const n = 50
	var leases, inFlight atomic.Int64
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
				if c.Lease.Attempt != 2 {
					t.Errorf("takeover attempt = %d, want 2", c.Lease.Attempt)
				}
			case errors.Is(err, idem.ErrInFlight):
				inFlight.Add(1)
			default:
				t.Errorf("Claim: %+v, %v", c, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if leases.Load() != 1 || inFlight.Load() != n-1 {
		t.Errorf("leases = %d, in flight = %d; want 1 and %d", leases.Load(), inFlight.Load(), n-1)
	}
}

// TestClaimDoesNotWaitOnOpenTransaction checks that a handler's open
// transaction, however long, never makes a claim on its key wait.
func TestClaimDoesNotWaitOnOpenTransaction(t *testing.T) {
	t.Parallel()
	s, _ := setup(t)
	ctx := context.Background()
	p := params("u1", "k1", "fp1")
	l := mustLease(t, s, p)
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	defer tx.Rollback(ctx)
	write(t, tx, "open")
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := s.Claim(cctx, p); !errors.Is(err, idem.ErrInFlight) {
		t.Errorf("Claim during the handler: got %v, want ErrInFlight at once", err)
	}
	if _, err := s.Claim(cctx, params("u1", "k1", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Errorf("Claim during the handler: got %v, want ErrFingerprintMismatch at once", err)
	}
}

func TestAbandoned(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	short := params("u1", "abandoned-1", "fp1")
	short.Lease = time.Second
	mustLease(t, s, short)
	b.clock.Advance(time.Millisecond)
	short.Key = "abandoned-2"
	mustLease(t, s, short)
	failed := mustLease(t, s, params("u1", "failed", "fp1"))
	if err := s.Fail(ctx, failed); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	mustLease(t, s, params("u1", "live", "fp1"))
	c := mustLease(t, s, params("u1", "completed", "fp1"))
	if err := complete(t, s, c, "x", response("x")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	exp := params("u1", "expired", "fp1")
	exp.Lease, exp.TTL = time.Millisecond, time.Second
	mustLease(t, s, exp)

	if recs, err := s.Abandoned(ctx, 10); err != nil || len(recs) != 1 || recs[0].Key != "failed" {
		t.Fatalf("Abandoned before the leases ran out = %v, %v; want failed alone", keys(recs), err)
	}
	b.clock.Advance(2 * time.Second)
	recs, err := s.Abandoned(ctx, 10)
	if err != nil {
		t.Fatalf("Abandoned: %v", err)
	}
	if got, want := keys(recs), "abandoned-1 abandoned-2 failed"; got != want {
		t.Errorf("Abandoned = %s, want %s (oldest first)", got, want)
	}
	if len(recs) > 0 && (!bytes.Equal(recs[0].Body, short.Body) || recs[0].Method != short.Method ||
		recs[0].Path != short.Path || recs[0].Header.Get("Content-Type") != "application/json") {
		t.Errorf("Abandoned[0] = %+v, want the stored request", recs[0])
	}
	if recs, err := s.Abandoned(ctx, 2); err != nil || keys(recs) != "abandoned-1 abandoned-2" {
		t.Errorf("Abandoned(2) = %s, %v", keys(recs), err)
	}
	if recs, err := s.Abandoned(ctx, 0); err != nil || len(recs) != 0 {
		t.Errorf("Abandoned(0) = %s, %v", keys(recs), err)
	}
}

func keys(recs []idem.Record) string {
	var b bytes.Buffer
	for i, r := range recs {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(r.Key)
	}
	return b.String()
}

func TestDeleteExpired(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	short := func(key string, lease time.Duration) idem.ClaimParams {
		p := params("u1", key, "fp1")
		p.TTL, p.Lease = time.Second, lease
		return p
	}
	c := mustLease(t, s, short("completed", time.Second))
	if err := complete(t, s, c, "x", response("x")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	mustLease(t, s, short("abandoned", time.Millisecond))
	mustLease(t, s, short("leased", time.Minute)) // expired but leased: kept
	mustLease(t, s, params("u1", "live", "fp1"))
	b.clock.Advance(2 * time.Second)

	if n, err := s.DeleteExpired(ctx, 0); err != nil || n != 0 {
		t.Errorf("DeleteExpired(0) = %d, %v; want 0", n, err)
	}
	if n, err := s.DeleteExpired(ctx, 1); err != nil || n != 1 {
		t.Errorf("DeleteExpired(1) = %d, %v; want 1", n, err)
	}
	if n, err := s.DeleteExpired(ctx, 10); err != nil || n != 1 {
		t.Errorf("DeleteExpired(10) = %d, %v; want 1", n, err)
	}
	var left []string
	rows, _ := b.pool.Query(ctx, `SELECT key FROM idempotency_keys ORDER BY key`)
	for rows.Next() {
		var k string
		rows.Scan(&k)
		left = append(left, k)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if got, want := len(left), 2; got != want || left[0] != "leased" || left[1] != "live" {
		t.Errorf("left = %v, want [leased live]", left)
	}
	// Once the lease runs out the expired key goes too.
	b.clock.Advance(time.Minute)
	if n, err := s.DeleteExpired(ctx, 10); err != nil || n != 1 {
		t.Errorf("DeleteExpired after the lease = %d, %v; want 1", n, err)
	}
}

func TestFromContext(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	if _, err := pgstore.FromContext(context.Background()); !errors.Is(err, idem.ErrNoTx) {
		t.Errorf("FromContext outside a request: got %v, want ErrNoTx", err)
	}
	h := idem.Middleware(s, idem.Options{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := pgstore.FromContext(r.Context())
		if err != nil {
			t.Errorf("FromContext: %v", err)
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if _, err := tx.Exec(r.Context(), `INSERT INTO effects (name) VALUES ('mw')`); err != nil {
			t.Errorf("insert: %v", err)
		}
		w.WriteHeader(http.StatusCreated)
	}))
	for range 2 {
		rec := httptest.NewRecorder()
		r := httptest.NewRequest(http.MethodPost, "/v1/orders", bytes.NewReader([]byte(`{}`)))
		r.Header.Set("Idempotency-Key", "mw-1")
		h.ServeHTTP(rec, r)
		if rec.Code != http.StatusCreated {
			t.Errorf("status = %d, want 201", rec.Code)
		}
	}
	if got := effects(t, b, "mw"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
}

func TestNilAndEmptyValues(t *testing.T) {
	t.Parallel()
	s, _ := setup(t)
	ctx := context.Background()
	p := params("", "k1", "fp1") // the middleware's default scope is ""
	p.Header, p.Body = nil, nil
	l := mustLease(t, s, p)
	rec, err := s.Get(ctx, "", "k1")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Header != nil || len(rec.Body) != 0 {
		t.Errorf("Get = header %v body %q, want none", rec.Header, rec.Body)
	}
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if err := tx.Complete(ctx, &idem.Response{Status: http.StatusNoContent, Header: http.Header{}}); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	c, err := s.Claim(ctx, p)
	if err != nil || c.Response == nil || c.Response.Status != http.StatusNoContent || len(c.Response.Body) != 0 || len(c.Response.Header) != 0 {
		t.Errorf("replay = %+v, %v; want an empty 204", c.Response, err)
	}
}
