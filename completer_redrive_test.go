package idem_test

// Regression tests from the seventh adversarial review of issue 8: an
// aborted re-drive took the process down, and the completer's own claim
// was neither bounded nor resent.

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

// leaveFailedAttempt leaves key k with a failed (502) first attempt in store,
// its lease ended, so the completer lists it at once.
func leaveFailedAttempt(t *testing.T, store idem.Store, opts idem.Options, k string) {
	t.Helper()
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusBadGateway) })
	req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"a":1}`))
	req.Header.Set("Idempotency-Key", k)
	req.Header.Set("Content-Type", "application/json")
	rw := httptest.NewRecorder()
	idem.Middleware(store, opts)(h).ServeHTTP(rw, req)
	if rw.Code != http.StatusBadGateway {
		t.Fatalf("first attempt: %d", rw.Code)
	}
}

// TestRunOnceRecoversAbortHandlerPanic checks that a re-drive whose
// handler panics with http.ErrAbortHandler does not panic out of RunOnce.
//
// It guards a bug found in review 7, as it was found: the middleware re-panics
// http.ErrAbortHandler so that net/http can drop the connection. A
// re-drive has no net/http under it: the panic goes through redrive and
// RunOnce into Completer.Run, a goroutine without recover (ordersapp runs
// it with `go s.completer.Run(bg)`), and kills the whole process, with
// every request it was serving (their keys stay leased). On restart the
// key is due again and it happens again, up to MaxAttempts times.
func TestRunOnceRecoversAbortHandlerPanic(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	store := memstore.New(memstore.Options{Now: func() time.Time { return now }})
	opts := idem.Options{User: idem.SharedKeySpace, Lease: time.Second}
	leaveFailedAttempt(t, store, opts, "k-abort")

	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { panic(http.ErrAbortHandler) })
	c := idem.NewCompleter(store, h, idem.CompleterOptions{MaxAttempts: 3, Middleware: opts})
	now = now.Add(time.Hour)
	var panicked any
	func() {
		defer func() { panicked = recover() }()
		_, _ = c.RunOnce(ctx) // a panic is the finding, not an error
	}()
	if panicked != nil {
		t.Errorf("RunOnce panicked with %v: in Completer.Run (its own goroutine) this crashes the process", panicked)
	}
}

// lostAnswerStore loses the answer of the first completer claim
// (ClaimParams.Redrive) after the store took it, as a connection that
// drops after the UPDATE commits does, and notes whether the completer's
// claim was bounded in time.
type lostAnswerStore struct {
	*memstore.Store
	mu        sync.Mutex
	lost      bool
	unbounded bool
}

func (s *lostAnswerStore) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	c, err := s.Store.Claim(ctx, p)
	if p.Redrive == nil {
		return c, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := ctx.Deadline(); !ok {
		s.unbounded = true
	}
	if err == nil && !s.lost {
		s.lost = true
		return idemdriver.Claim{}, errors.New("read tcp: connection reset by peer")
	}
	return c, err
}

// TestRedriveClaimSentAgainAfterLostAnswer checks that the completer's
// claim is sent again after a lost answer (same owner: safe) and bounded
// by claimTimeout, as the middleware's claim is.
//
// It guards a bug found in review 7, as it was found: the completer's claim now goes to
// the store directly, not through the middleware's claim (m.claim and
// m.retry): it is not sent again after an error, although the same owner
// makes that safe (Store.Claim's contract, and what the middleware did
// for this claim before HEAD), and it is bounded by neither claimTimeout
// nor the retry budget. A lost answer (a blip after the commit) spends a
// re-drive of the budget, runs nothing, and leaves the key leased to
// nobody for a whole lease (no Lease to Fail), then waits its backoff:
// the very case the middleware's retry exists for ("a short blip must
// not leave a key claimed ... for a whole lease").
func TestRedriveClaimSentAgainAfterLostAnswer(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	store := &lostAnswerStore{Store: memstore.New(memstore.Options{Now: func() time.Time { return now }})}
	opts := idem.Options{User: idem.SharedKeySpace, Lease: 30 * time.Second}
	leaveFailedAttempt(t, store, opts, "k-lost")

	ran := 0
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran++
		w.WriteHeader(http.StatusCreated)
	})
	c := idem.NewCompleter(store, h, idem.CompleterOptions{MaxAttempts: 3, Middleware: opts})
	now = now.Add(time.Hour)
	st, err := c.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := store.Get(ctx, "", "k-lost")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("stats %+v; handler runs %d; redrives %d; lease until %v (now %v); response %v", st, ran, rec.Redrives, rec.LeaseUntil, now, rec.Response != nil)
	if ran != 1 || rec.Response == nil {
		t.Errorf("a claim whose answer was lost was not sent again (same owner: safe): handler runs %d, key completed %v, re-drive spent (redrives %d), key held by nobody until %v",
			ran, rec.Response != nil, rec.Redrives, rec.LeaseUntil.Sub(now))
	}
	if store.unbounded {
		t.Errorf("the completer's claim ran with no deadline (the middleware bounds every claim by claimTimeout): a hung store call stops the completer")
	}
}
