package everystore_test

// Regression tests from the fifth adversarial review of issue 8 (the
// store-held completer state): each failed on main before completers'
// claims took only the listed operation, only while due.

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

// staleSweeper is one instance's view of a shared store: its Abandoned
// lists from the store and then waits at gate, so that several instances
// list at the same moment (their tickers in phase) and then re-drive one
// after the other, as instances do whose scans overlap.
type staleSweeper struct {
	*memstore.Store
	listed chan<- struct{}
	gate   <-chan struct{}
}

func (s staleSweeper) Abandoned(ctx context.Context, p idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	recs, err := s.Store.Abandoned(ctx, p)
	s.listed <- struct{}{}
	<-s.gate
	return recs, err
}

// TestStaleListingsKeepBackoffAndBudget checks that completers whose scans
// share one stale listing keep a failing key's backoff and budget.
//
// It guards a bug found in review 5, as it was found: Abandoned lists only
// due keys, but a completer claims from its listing later, and the claim
// (ClaimParams.Redrive) only checks that the lease ran out, not that the
// key is still due. Instances whose scans list at about the same time
// share one stale list: the first re-drives the key, which fails fast
// (gateway down: a 502 at once) and so ends its lease; the next instance
// reaches the key in its list and takes it over at once, ignoring the
// backoff the store just started, and so on. Each instance spends one
// re-drive of the shared budget per scan, back to back: with as many
// instances as MaxAttempts the key is given up within one scan, in
// milliseconds, instead of after the capped exponential backoff ("about a
// quarter of an hour" with the defaults), and the payment its first
// attempt may have made is left without its order.
func TestStaleListingsKeepBackoffAndBudget(t *testing.T) {
	store := memstore.New(memstore.Options{})
	ctx := context.Background()
	failOneAttempt(t, store, "paid") // abandoned after a 5xx; may have paid
	const instances = 4
	var mu sync.Mutex
	runs := 0
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		runs++
		mu.Unlock()
		w.WriteHeader(http.StatusBadGateway) // the gateway is down for a few seconds
	})
	opts := idem.CompleterOptions{MaxAttempts: instances, Backoff: time.Hour, MaxBackoff: time.Hour, Batch: 10,
		Middleware: idem.Options{Fingerprint: func(*http.Request, []byte) (string, error) { return "f", nil }}}
	listed := make(chan struct{})
	gates := make([]chan struct{}, instances)
	dones := make([]chan struct{}, instances)
	for i := range instances {
		gates[i], dones[i] = make(chan struct{}), make(chan struct{})
		c := idem.NewCompleter(staleSweeper{store, listed, gates[i]}, next, opts)
		go func() {
			defer close(dones[i])
			if _, err := c.RunOnce(ctx); err != nil {
				t.Error(err)
			}
		}()
	}
	for range instances { // every instance's scan lists at the same moment
		<-listed
	}
	start := time.Now()
	for i := range instances { // then they re-drive, one after the other
		close(gates[i])
		<-dones[i]
	}
	rec, err := store.Get(ctx, "u", "paid")
	if err != nil {
		t.Fatal(err)
	}
	if runs > 1 || rec.Redrives > 1 {
		t.Errorf("%d instances scanning at once re-drove one failing key %d times within %v (redrives %d of MaxAttempts %d, backoff 1h): "+
			"each claimed from its stale listing as soon as the previous re-drive's Fail ended the lease; want 1, the others waiting for the backoff",
			instances, runs, time.Since(start).Round(time.Millisecond), rec.Redrives, opts.MaxAttempts)
	}
	if due, _ := store.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10, MaxRedrives: opts.MaxAttempts}); len(due) == 0 {
		t.Errorf("the key is given up (redrives %d >= %d) within one scan, with no backoff ever waited", rec.Redrives, opts.MaxAttempts)
	}
}

// fixedSweeper is an instance whose listing was made earlier: Abandoned
// returns recs.
type fixedSweeper struct {
	*memstore.Store
	recs []idemdriver.Record
}

func (s fixedSweeper) Abandoned(context.Context, idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	return s.recs, nil
}

// TestGuardCountsNoRedriveOnAnotherOperation checks that a completer's
// claim of a key whose listed operation is gone counts no re-drive of the
// operation now there.
//
// It guards a bug found in review 5, as it was found: the guard that answers
// 412 when the claimed operation is not the one listed runs after the
// claim, and the claim (Redrive) has already counted a re-drive in the
// record it took over. Listed: operation A (its lease ran out while its
// first attempt still ran). A's attempt then answers 4xx and, being the
// first, releases the key. The client sends the request again: a new
// operation B, which pays and crashes. A completer reaching A in its stale
// listing takes B over (same key, same fingerprint, lease over), counts a
// re-drive of B, and the guard refuses to run it (412; Fail ends the
// lease at once). Every instance holding A in its listing does the same:
// B's budget is spent and B is given up without ever being re-driven.
func TestGuardCountsNoRedriveOnAnotherOperation(t *testing.T) {
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	var cmu sync.Mutex
	clock := func() time.Time { cmu.Lock(); defer cmu.Unlock(); return now }
	advance := func(d time.Duration) { cmu.Lock(); now = now.Add(d); cmu.Unlock() }
	store := memstore.New(memstore.Options{Now: clock})
	ctx := context.Background()
	p := idemdriver.ClaimParams{User: "u", Key: "k", Fingerprint: "f", Method: "POST", Path: "/x", Lease: time.Second}

	// Operation A: its first attempt outlives its lease; the instances list it.
	p.Owner = idemdriver.NewOwner()
	a, err := store.Claim(ctx, p)
	if err != nil || a.Lease == nil {
		t.Fatal(a, err)
	}
	advance(2 * time.Second)
	stale, err := store.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10})
	if err != nil || len(stale) != 1 {
		t.Fatal(stale, err)
	}
	// A's attempt answers 422 (first attempt): the middleware releases the key.
	if err := store.Release(ctx, a.Lease); err != nil {
		t.Fatal(err)
	}
	// Operation B: the same request again, a new operation; it pays, and its instance crashes.
	advance(time.Millisecond)
	p.Owner = idemdriver.NewOwner()
	if b, err := store.Claim(ctx, p); err != nil || b.Lease == nil {
		t.Fatal(b, err)
	}
	advance(2 * time.Second)

	const maxAttempts = 3
	runs := 0
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs++; w.WriteHeader(http.StatusCreated) })
	opts := idem.CompleterOptions{MaxAttempts: maxAttempts, Backoff: time.Second, Batch: 10,
		Middleware: idem.Options{Fingerprint: func(*http.Request, []byte) (string, error) { return "f", nil }}}
	for range maxAttempts { // instances that listed A reach it in their stale listings
		c := idem.NewCompleter(fixedSweeper{store, stale}, next, opts)
		st, err := c.RunOnce(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("stale scan: %+v", st)
	}
	rec, err := store.Get(ctx, "u", "k")
	if err != nil {
		t.Fatal(err)
	}
	if rec.Redrives != 0 {
		t.Errorf("operation B (never re-driven: %d runs) has redrives %d: each 412 from the guard (the listed operation A is gone) counted a re-drive of B", runs, rec.Redrives)
	}
	advance(time.Hour) // any backoff passed
	if due, _ := store.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10, MaxRedrives: maxAttempts}); len(due) == 0 {
		t.Errorf("operation B, whose attempt may have paid, is given up (redrives %d >= %d) without a single re-drive", rec.Redrives, maxAttempts)
	}
}

// TestBackoffAfterCapped checks that BackoffAfter with a cap returns the
// cap, as the SQL stores compute it.
//
// It guards a bug found in review 5, as it was found: with a cap, BackoffAfter returns
// math.MaxInt64 once the doubled backoff passes MaxInt64/2, not the cap;
// sqlitestore and pgstore use the cap (min(Backoff·2^(n−1), MaxBackoff)),
// so Due and the SQL stores disagree there.
func TestBackoffAfterCapped(t *testing.T) {
	p := idemdriver.AbandonedParams{Backoff: 1<<62 + 1, MaxBackoff: 1<<62 + 1<<61}
	if got := p.BackoffAfter(2); got != p.MaxBackoff {
		t.Errorf("BackoffAfter(2) with Backoff %d, MaxBackoff %d = %d; want the cap %d", p.Backoff, p.MaxBackoff, got, p.MaxBackoff)
	}
}

// failOneAttempt claims key for user "u" in store and fails the attempt at
// once, as an attempt that answered 5xx does: one more attempt, lease over.
func failOneAttempt(t *testing.T, store *memstore.Store, key string) {
	t.Helper()
	ctx := context.Background()
	c, err := store.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: key, Fingerprint: "f", Owner: idemdriver.NewOwner(), Method: "POST", Path: "/x"})
	if err != nil || c.Lease == nil {
		t.Fatalf("claim %s: %+v %v", key, c, err)
	}
	if err := store.Fail(ctx, c.Lease); err != nil {
		t.Fatal(err)
	}
}
