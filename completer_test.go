package idem_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/storetest"
)

// TestCompleterFinishesAbandoned: an attempt whose instance died leaves a
// claimed key; once its lease ran out the completer runs the stored request
// as its user, and the client's retry gets that answer replayed. The
// lease runs out on the store's fake clock.
func TestCompleterFinishesAbandoned(t *testing.T) {
	clk := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	store := memstore.New(memstore.Options{Now: clk.Now})
	var runs, effects atomic.Int64
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		tx, err := memstore.FromContext(r.Context())
		if err != nil {
			t.Errorf("no tx: %v", err)
			return
		}
		tx.OnCommit(func() { effects.Add(1) })
		l, _ := idem.LeaseFromContext(r.Context())
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"user":%q,"body":%s,"ct":%q}`, l.User, body, r.Header.Get("Content-Type"))
	})
	opts := idem.Options{Lease: time.Second, Now: clk.Now, User: func(r *http.Request) string { return r.Header.Get("X-User") }}

	// The crashed attempt: claimed, never finished. Its key has a quote in it.
	key := `k"1`
	fp, err := idem.Fingerprint(httptest.NewRequest("POST", "/v1/things", nil), []byte(`{"n":1}`))
	if err != nil {
		t.Fatal(err)
	}
	_, err = store.Claim(context.Background(), idemdriver.ClaimParams{
		User: "alice", Key: key, Fingerprint: fp,
		Method: "POST", Path: "/v1/things", Header: http.Header{"Content-Type": {"application/json"}},
		Body: []byte(`{"n":1}`), Lease: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	c := idem.NewCompleter(store, next, idem.CompleterOptions{Middleware: opts})
	st, err := c.RunOnce(context.Background())
	if err != nil || st.Completed != 0 || runs.Load() != 0 {
		t.Fatalf("within the lease: %+v %v, runs %d; want nothing done", st, err, runs.Load())
	}
	clk.Advance(1100 * time.Millisecond) // past the lease
	st, err = c.RunOnce(context.Background())
	if err != nil || st.Completed != 1 {
		t.Fatalf("after the lease: %+v %v, want one completed", st, err)
	}
	if effects.Load() != 1 {
		t.Fatalf("effects = %d, want 1", effects.Load())
	}

	// The client comes back: replayed, not run again.
	srv := httptest.NewServer(idem.Middleware(store, opts)(next))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/v1/things", strings.NewReader(`{"n":1}`))
	req.Header.Set("X-User", "alice")
	req.Header.Set("Idempotency-Key", `"k\"1"`)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	want := `{"user":"alice","body":{"n":1},"ct":"application/json"}`
	if resp.StatusCode != 201 || string(b) != want || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("client retry: %d %s replayed=%q; want 201 %s replayed", resp.StatusCode, b, resp.Header.Get("Idempotent-Replayed"), want)
	}
	if runs.Load() != 1 {
		t.Errorf("runs = %d, want 1", runs.Load())
	}
}

// TestCompleterBoundedAttempts: a request that keeps failing is re-driven
// with backoff and given up after MaxAttempts re-drives of its own. The
// backoff passes on the store's fake clock.
func TestCompleterBoundedAttempts(t *testing.T) {
	clk := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	store := memstore.New(memstore.Options{Now: clk.Now})
	var runs atomic.Int64
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		http.Error(w, "down", http.StatusBadGateway)
	})
	opts := idem.Options{Now: clk.Now, User: func(r *http.Request) string { return "u" }}
	srv := httptest.NewServer(idem.Middleware(store, opts)(next))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "k")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Fatalf("first: %d", resp.StatusCode)
	}
	c := idem.NewCompleter(store, next, idem.CompleterOptions{Middleware: opts, MaxAttempts: 3, Backoff: 50 * time.Millisecond})
	// Scans 10 ms apart on the store's clock, for at most 5 s of it.
	for i := 0; runs.Load() < 4 && i < 500; i++ {
		if _, err := c.RunOnce(context.Background()); err != nil {
			t.Fatal(err)
		}
		clk.Advance(10 * time.Millisecond)
	}
	clk.Advance(300 * time.Millisecond) // past any further backoff
	st, _ := c.RunOnce(context.Background())
	rec, err := store.Get(context.Background(), "u", "k")
	if runs.Load() != 4 || st.Scanned != 0 || err != nil || rec.Redrives != 3 {
		t.Fatalf("runs = %d, last scan %+v, record %+v, %v; want 4 runs (the client's and 3 re-drives), 3 re-drives counted, the key no longer listed", runs.Load(), st, rec, err)
	}
}

// TestCompleterBudgetIsItsOwn: a client that retried all through an
// outage (here 25 attempts, each a 503) does not spend the completer's
// budget: once the outage ends, the completer still finishes the request,
// whose first attempt may have paid.
func TestCompleterBudgetIsItsOwn(t *testing.T) {
	store := memstore.New(memstore.Options{})
	var down atomic.Bool
	down.Store(true)
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if down.Load() {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	opts := idem.Options{User: func(r *http.Request) string { return "u" }}
	srv := httptest.NewServer(idem.Middleware(store, opts)(next))
	defer srv.Close()
	for range 25 {
		req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	down.Store(false)
	c := idem.NewCompleter(store, next, idem.CompleterOptions{Middleware: opts})
	st, err := c.RunOnce(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	rec, err := store.Get(context.Background(), "u", "k")
	if err != nil || rec.Response == nil || rec.Response.Status != http.StatusCreated || st.Completed != 1 {
		t.Fatalf("after 25 client attempts and one scan: record %+v, %v, scan %+v; want the request completed", rec, err, st)
	}
}

// TestCompleterNotCrowdedOut: keys the completer gave up on must not fill
// its batch and hide a newer abandoned request. The backoff passes on the
// store's fake clock.
func TestCompleterNotCrowdedOut(t *testing.T) {
	clk := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	store := memstore.New(memstore.Options{Now: clk.Now})
	ctx := context.Background()
	claim := func(key string) *idemdriver.Lease {
		c, err := store.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: key, Fingerprint: "f", Method: "POST", Path: "/x"})
		if err != nil || c.Lease == nil {
			t.Fatalf("claim %s: %+v %v", key, c, err)
		}
		return c.Lease
	}
	const batch = 10
	for i := 0; i < batch; i++ {
		if err := store.Fail(ctx, claim(fmt.Sprintf("failing-%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	var ran []string
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l, _ := idem.LeaseFromContext(r.Context())
		ran = append(ran, l.Key)
		if strings.HasPrefix(l.Key, "failing-") {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	c := idem.NewCompleter(store, next, idem.CompleterOptions{MaxAttempts: 2, Backoff: time.Millisecond, Batch: batch,
		Middleware: idem.Options{Fingerprint: func(*http.Request, []byte) (string, error) { return "f", nil }}})
	for range 5 { // the failing keys spend their budget
		if _, err := c.RunOnce(ctx); err != nil {
			t.Fatal(err)
		}
		clk.Advance(5 * time.Millisecond)
	}
	if len(ran) != 2*batch {
		t.Fatalf("re-drives of the failing keys = %d, want %d (MaxAttempts each)", len(ran), 2*batch)
	}
	ran = nil
	if err := store.Fail(ctx, claim("new")); err != nil {
		t.Fatal(err)
	}
	st, err := c.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ran) != 1 || ran[0] != "new" || st.Completed != 1 {
		t.Errorf("ran %v, stats %+v; want the new key completed", ran, st)
	}
}

// TestBackoffAfterNeverWraps: without a cap the pause grows until it
// stands for "never"; it never wraps round to "at once".
func TestBackoffAfterNeverWraps(t *testing.T) {
	p := idemdriver.AbandonedParams{Backoff: time.Second}
	for _, n := range []int{0, 1, 2, 40, 100, 1000} {
		got := p.BackoffAfter(n)
		if n >= 1 && got < time.Second || n >= 40 && got < time.Duration(1)<<62 {
			t.Errorf("BackoffAfter(%d) = %v, want it to keep growing", n, got)
		}
	}
	capped := idemdriver.AbandonedParams{Backoff: time.Second, MaxBackoff: time.Minute}
	if got := capped.BackoffAfter(1000); got != time.Minute {
		t.Errorf("capped BackoffAfter(1000) = %v, want 1m", got)
	}
}

// TestCompleterGivingUpIsLoud: the re-drive that spends a key's budget is
// counted (CompleterStats.GivenUp, Metrics.GivenUp) and logged with the
// user and an operation id, never the key. The backoff passes on the
// store's fake clock.
func TestCompleterGivingUpIsLoud(t *testing.T) {
	clk := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	store := memstore.New(memstore.Options{Now: clk.Now})
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "down", http.StatusBadGateway)
	})
	var logs strings.Builder
	var mu sync.Mutex
	logger := slog.New(slog.NewTextHandler(lockedWriter{&mu, &logs}, nil))
	metrics := new(idem.Metrics)
	opts := idem.Options{Now: clk.Now, User: func(r *http.Request) string { return "u" }, Metrics: metrics, Logger: logger}
	srv := httptest.NewServer(idem.Middleware(store, opts)(next))
	defer srv.Close()
	const key = "secret-card-4242"
	req, _ := http.NewRequest("POST", srv.URL+"/x", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	c := idem.NewCompleter(store, next, idem.CompleterOptions{Middleware: opts, MaxAttempts: 2, Backoff: time.Millisecond, Logger: logger})
	var given int
	for range 10 {
		st, err := c.RunOnce(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		given += st.GivenUp
		clk.Advance(5 * time.Millisecond)
	}
	rec, _ := store.Get(context.Background(), "u", key)
	mu.Lock()
	out := logs.String()
	mu.Unlock()
	if given != 1 || metrics.GivenUp.Load() != 1 || rec == nil || rec.Redrives != 2 {
		t.Errorf("GivenUp in stats %d, in metrics %d, record %+v; want 1, 1 and 2 re-drives", given, metrics.GivenUp.Load(), rec)
	}
	if !strings.Contains(out, "gave a request up") || !strings.Contains(out, idemdriver.OperationID("u", key, rec.CreatedAt)) {
		t.Errorf("log does not say the request was given up, with its operation id:\n%s", out)
	}
	if strings.Contains(out, key) {
		t.Errorf("log shows the key %q:\n%s", key, out)
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
