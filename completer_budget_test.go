package idem_test

// Regression tests from the fourth adversarial review of issue 8 (the
// completer of 2803b40, whose budget and backoff lived in memory). Each
// failed on main as of dac673d.

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/storetest"
)

// TestTwoCompletersKeepEachOthersBudget checks that two completers whose
// scans overlap each other's re-drives keep a failing key's budget and
// backoff: it is re-driven at most MaxAttempts times.
//
// It guards a bug found in review 4, as it was found: a completer forgets
// every operation absent from a complete listing, and Abandoned lists
// only keys whose lease ran out. So a key that another attempt holds at
// the moment of a scan (the other instance's completer re-driving it, or
// a client's retry) is forgotten, budget and backoff with it, and the next
// time it is abandoned it is "seen anew": due at once, with a full budget.
// Two instances whose scans overlap each other's re-drives (certain when a
// re-drive takes longer than Interval, as against a gateway that hangs
// until PaymentTimeout) thus re-drive a failing key at every scan, with no
// backoff and without bound, though each has MaxAttempts 2 and a backoff
// of an hour. Here the overlap is made deterministic: while one
// completer's re-drive runs, the other scans.
func TestTwoCompletersKeepEachOthersBudget(t *testing.T) {
	store := memstore.New(memstore.Options{})
	ctx := context.Background()
	failClientAttempt(t, store, "failing") // abandoned after a 5xx
	var (
		other  *idem.Completer
		nested bool
		runs   int
	)
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		if !nested && other != nil { // the other instance scans meanwhile
			nested = true
			if _, err := other.RunOnce(ctx); err != nil {
				t.Error(err)
			}
			nested = false
		}
		w.WriteHeader(http.StatusBadGateway)
	})
	opts := idem.CompleterOptions{MaxAttempts: 2, Backoff: time.Hour, MaxBackoff: time.Hour, Batch: 10,
		Middleware: idem.Options{Fingerprint: func(*http.Request, []byte) (string, error) { return "f", nil }}}
	a := idem.NewCompleter(store, next, opts)
	b := idem.NewCompleter(store, next, opts)
	for range 20 { // 20 scans of each instance, well within the hour of backoff
		other = b
		if _, err := a.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
		other = a
		if _, err := b.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	// Each completer may re-drive the key once (its first re-drive is due
	// at once; its second an hour later): 2 in all, never more than
	// 2×MaxAttempts.
	if runs > 2*opts.MaxAttempts {
		t.Errorf("two completers (MaxAttempts %d, backoff 1h) re-drove one failing key %d times in 40 scans; want at most %d: "+
			"each forgot the key while the other held its lease, and then saw it anew, due at once with a fresh budget",
			opts.MaxAttempts, runs, 2*opts.MaxAttempts)
	}
}

// TestCompleterListsKeyBehindManyGivenUpKeys checks that a key whose
// client retried often is still re-driven when more than 9×Batch keys were
// given up.
//
// It guards a bug found in review 4, as it was found: 2803b40
// lists Batch more keys than the completer knows to be waiting, but never
// more than 10×Batch. The third review's hole (keys the completer gave up
// on, which sort first since the list is "fewest attempts first", hide a
// key whose client retried more often) is back once more than 9×Batch
// keys are given up: in serve (Batch 100) 901 keys given up after 21
// attempts, say after an outage of the gateway under load, hide for good
// every key whose client retried 22 times or more; that key's payment
// never gets its order. Scaled down: Batch 2, MaxAttempts 1, 25 keys
// given up, one key with 10 client attempts. The backoff passes on the
// store's fake clock.
func TestCompleterListsKeyBehindManyGivenUpKeys(t *testing.T) {
	clk := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	store := memstore.New(memstore.Options{Now: clk.Now})
	ctx := context.Background()
	const batch, givenUp = 2, 25
	for i := range givenUp {
		failClientAttempt(t, store, fmt.Sprintf("failing-%02d", i))
	}
	ranPaid := 0
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l, _ := idem.LeaseFromContext(r.Context())
		if l.Key == "paid" {
			ranPaid++
			w.WriteHeader(http.StatusCreated)
			return
		}
		w.WriteHeader(http.StatusBadGateway)
	})
	c := idem.NewCompleter(store, next, idem.CompleterOptions{MaxAttempts: 1, Backoff: time.Millisecond, Batch: batch,
		Middleware: idem.Options{Fingerprint: func(*http.Request, []byte) (string, error) { return "f", nil }}})
	for range 40 { // the failing keys spend the completer's budget
		if _, err := c.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for range 10 { // a client retried through the outage; its first attempt paid
		failClientAttempt(t, store, "paid")
	}
	for range 40 {
		if _, err := c.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
		clk.Advance(2 * time.Millisecond)
	}
	if ranPaid == 0 {
		t.Errorf("with %d keys given up (more than 9×Batch %d), a key whose client retried 10 times was never re-driven in 40 scans: "+
			"it sorts after them and the scan lists at most 10×Batch; its payment never gets its order", givenUp, batch)
	}
}
