package idem_test

// Regression tests from the third adversarial review of issue 8 (the
// completer's schedule). Each failed on main as of 970c2de.

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/storetest"
)

// failClientAttempt claims key for user "u" in store and fails the attempt at
// once, as an attempt that answered 5xx does: one more attempt, lease over.
func failClientAttempt(t *testing.T, store *memstore.Store, key string) {
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

// TestCompleterListsKeyWithMoreClientAttemptsThanGivenUpKeys checks that a
// key whose client retried more often than the completer's budget is still
// listed and re-driven when a Batch of keys the completer gave up on sorts
// ahead of it.
//
// It guards a bug found in review 3, as it was found: the completer
// lists abandoned keys "fewest attempts first" and counts its budget apart
// from the clients' attempts. Keys it gave up on keep the attempts they
// reached (MaxAttempts re-drives + 1); a key whose client retried more
// often than that through an outage (which the new budget rule exists
// for) sorts after them, so once a Batch of given-up keys exists it is
// never listed again: its payment is never given its order. (Scaled
// down: Batch 2, MaxAttempts 2; in serve, 100 keys given up after 21
// attempts hide every key whose client retried 22 times or more.) The
// backoff passes on the store's fake clock.
func TestCompleterListsKeyWithMoreClientAttemptsThanGivenUpKeys(t *testing.T) {
	clk := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	store := memstore.New(memstore.Options{Now: clk.Now})
	ctx := context.Background()
	const batch = 2
	for i := range batch {
		failClientAttempt(t, store, fmt.Sprintf("failing-%d", i))
	}
	var mu sync.Mutex
	var ran []string
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l, _ := idem.LeaseFromContext(r.Context())
		mu.Lock()
		ran = append(ran, l.Key)
		mu.Unlock()
		if strings.HasPrefix(l.Key, "failing-") {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	c := idem.NewCompleter(store, next, idem.CompleterOptions{MaxAttempts: 2, Backoff: time.Millisecond, Batch: batch,
		Middleware: idem.Options{Fingerprint: func(*http.Request, []byte) (string, error) { return "f", nil }}})
	for range 6 { // the failing keys spend the completer's budget: 3 attempts each
		if _, err := c.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
		clk.Advance(5 * time.Millisecond)
	}
	// Meanwhile a client retried its key 5 times through the outage, each
	// attempt a 5xx (the first one paid, its answer lost).
	for range 5 {
		failClientAttempt(t, store, "paid")
	}
	for range 10 {
		if _, err := c.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
		clk.Advance(5 * time.Millisecond)
	}
	rec, err := store.Get(ctx, "u", "paid")
	if err != nil {
		t.Fatal(err)
	}
	if rec.Response == nil {
		mu.Lock()
		defer mu.Unlock()
		t.Errorf("key %q (%d client attempts) was never re-driven (re-drives: %v): the keys the completer gave up on fill its batch ahead of it", "paid", rec.Attempts, ran)
	}
}

// TestCompleterKeepsBudgetWithMoreKeysThanBatch checks that a failing key
// is re-driven at most MaxAttempts times, with its backoff, when more keys
// than Batch are abandoned.
//
// It guards a bug found in review 3, as it was found: the completer's budget
// is counted in memory for the keys of the last scan only. With more
// abandoned keys than Batch, each re-drive moves a key behind the others
// (one more attempt), out of the next scan, and out of the completer's
// memory; when it comes back it is "first seen" again, with a fresh budget
// and no backoff. A key that always fails is then re-driven forever, at
// every other scan, instead of MaxAttempts times. (Scaled down: Batch 1,
// two keys; in serve, 101 failing keys.)
func TestCompleterKeepsBudgetWithMoreKeysThanBatch(t *testing.T) {
	store := memstore.New(memstore.Options{})
	ctx := context.Background()
	failClientAttempt(t, store, "a")
	failClientAttempt(t, store, "b")
	var mu sync.Mutex
	runs := map[string]int{}
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l, _ := idem.LeaseFromContext(r.Context())
		mu.Lock()
		runs[l.Key]++
		mu.Unlock()
		w.WriteHeader(http.StatusBadGateway)
	})
	const maxAttempts = 2
	c := idem.NewCompleter(store, next, idem.CompleterOptions{MaxAttempts: maxAttempts, Backoff: time.Hour, MaxBackoff: time.Hour, Batch: 1,
		Middleware: idem.Options{Fingerprint: func(*http.Request, []byte) (string, error) { return "f", nil }}})
	for range 20 {
		if _, err := c.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for k, n := range runs {
		// With a one-hour backoff, even one re-drive after the first is
		// impossible within this test: at most 1 each.
		if n > 1 {
			t.Errorf("key %q re-driven %d times in 20 scans with a 1h backoff and MaxAttempts %d: the budget and the backoff are forgotten when a key leaves the batch", k, n, maxAttempts)
		}
	}
}
