package idem_test

// Regression tests from the sixth adversarial review of issue 8: a
// re-drive refused before the store counted it kept its key listed for
// ever, ahead of the keys that were due.

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

// TestCompleterRedrivesDoubleSlashPath checks that a key whose path begins
// with "//" is re-driven (its fingerprint rebuilt as stored), and does not
// keep a due key behind it from being re-driven.
//
// It guards a bug found in review 6, as it was found: the completer
// rebuilds the request from Record.Path (r.URL.RequestURI() of the
// original) with http.NewRequest, which parses it with url.Parse, not as a
// request target. An origin-form target beginning with "//" ("//x/orders",
// which net/http serves as the path "//x/orders" when the middleware wraps
// the handler directly, with no ServeMux to clean it) comes back as host
// "x" and path "/orders": another EscapedPath, so another fingerprint. The
// completer's claim is then answered ErrFingerprintMismatch on every scan:
// nothing is counted (Redrives stays 0, the lease end does not move), so the
// key is never re-driven, never given up, and stays first in Abandoned's
// order forever. Batch such keys (any client can make them: a 5xx, or a
// crash) fill every scan, and a due key behind them is never re-driven:
// its payment is left without its order.
func TestCompleterRedrivesDoubleSlashPath(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	clock := func() time.Time { return now }
	store := memstore.New(memstore.Options{Now: clock})

	fail := true
	ran := map[string]int{}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran[r.URL.Path]++
		if fail {
			w.WriteHeader(http.StatusBadGateway) // gateway down: key kept, to be re-driven
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	opts := idem.Options{User: idem.SharedKeySpace, Lease: time.Second}
	api := idem.Middleware(store, opts)(h)

	// The first key: its target begins with "//".
	req := httptest.NewRequest(http.MethodPost, "//x/orders", strings.NewReader(`{"a":1}`))
	req.Header.Set("Idempotency-Key", "k-slash")
	req.Header.Set("Content-Type", "application/json")
	rw := httptest.NewRecorder()
	api.ServeHTTP(rw, req)
	if rw.Code != http.StatusBadGateway {
		t.Fatalf("first request: %d", rw.Code)
	}
	now = now.Add(time.Millisecond)
	// A second, ordinary key, failed a moment later.
	req = httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"a":2}`))
	req.Header.Set("Idempotency-Key", "k-plain")
	req.Header.Set("Content-Type", "application/json")
	rw = httptest.NewRecorder()
	api.ServeHTTP(rw, req)
	if rw.Code != http.StatusBadGateway {
		t.Fatalf("second request: %d", rw.Code)
	}

	fail = false // the gateway is back
	c := idem.NewCompleter(store, h, idem.CompleterOptions{Batch: 1, MaxAttempts: 3, Backoff: time.Second, MaxBackoff: time.Second, Middleware: opts})
	for i := range 10 { // bounded: ten scans, an hour apart
		now = now.Add(time.Hour)
		if _, err := c.RunOnce(ctx); err != nil {
			t.Fatalf("scan %d: %v", i, err)
		}
	}
	rec, err := store.Get(ctx, "", "k-slash")
	if err != nil {
		t.Fatal(err)
	}
	plain, err := store.Get(ctx, "", "k-plain")
	if err != nil {
		t.Fatal(err)
	}
	listed, _ := store.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10, MaxRedrives: 3, Backoff: time.Second, MaxBackoff: time.Second})
	t.Logf("k-slash: redrives %d attempts %d response %v; k-plain: redrives %d response %v; still listed: %d; handler runs %v",
		rec.Redrives, rec.Attempts, rec.Response != nil, plain.Redrives, plain.Response != nil, len(listed), ran)
	if rec.Response == nil && rec.Redrives == 0 {
		t.Errorf("k-slash (path %q) was never re-driven in 10 scans and is never given up: the completer's fingerprint differs from the stored one", rec.Path)
	}
	if plain.Response == nil {
		t.Errorf("k-plain, due all along, was never re-driven: k-slash fills every scan (Batch 1)")
	}
}

// TestCompleterCountsUnparsablePath checks that a key whose path cannot be
// rebuilt as a request has its failed re-drives counted, so that it is
// given up rather than listed first forever.
//
// It guards a bug found in review 6, as it was found: the same root cause, worse: a
// target such as "//[x/orders" (served as that path) cannot be rebuilt at
// all (url.Parse: "missing ']' in host"). The completer answers itself 500
// before claiming: nothing is counted, and the key is listed, first, on
// every scan, never re-driven and never given up.
func TestCompleterCountsUnparsablePath(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	store := memstore.New(memstore.Options{Now: func() time.Time { return now }})
	fail := true
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if fail {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	opts := idem.Options{User: idem.SharedKeySpace, Lease: time.Second}
	req := httptest.NewRequest(http.MethodPost, "//[x/orders", strings.NewReader(`{"a":1}`))
	req.Header.Set("Idempotency-Key", "k-bracket")
	rw := httptest.NewRecorder()
	idem.Middleware(store, opts)(h).ServeHTTP(rw, req)
	if rw.Code != http.StatusBadGateway {
		t.Fatalf("first request: %d", rw.Code)
	}
	fail = false
	c := idem.NewCompleter(store, h, idem.CompleterOptions{MaxAttempts: 3, Backoff: time.Second, MaxBackoff: time.Second, Middleware: opts})
	var st idem.CompleterStats
	for range 5 {
		now = now.Add(time.Hour)
		s, err := c.RunOnce(ctx)
		if err != nil {
			t.Fatal(err)
		}
		st.Failed += s.Failed
	}
	rec, err := store.Get(ctx, "", "k-bracket")
	if err != nil {
		t.Fatal(err)
	}
	if rec.Response == nil && rec.Redrives == 0 {
		t.Errorf("k-bracket (path %q): 5 scans, %d failed re-drives, none counted (redrives %d): never re-driven, never given up", rec.Path, st.Failed, rec.Redrives)
	}
}
