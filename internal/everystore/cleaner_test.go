package everystore_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"go/parser"
	"go/token"
	"log/slog"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/storetest"
)

// The stores a Completer takes are SweepingStores, checked when built.
var _ idemdriver.SweepingStore = (*memstore.Store)(nil)

// fillKeys makes, on s at clock's time, n completed keys that live ttl,
// and returns the keys.
func fillKeys(t *testing.T, s idem.Store, prefix string, n int, ttl time.Duration, answer bool) []string {
	t.Helper()
	ctx := context.Background()
	var keys []string
	for i := range n {
		k := fmt.Sprintf("%s-%d", prefix, i)
		cl, err := s.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: k, Fingerprint: "f", Owner: idemdriver.NewOwner(), TTL: ttl, Lease: time.Second})
		if err != nil || cl.Lease == nil {
			t.Fatalf("Claim %s: %+v, %v", k, cl, err)
		}
		if answer {
			tx, err := s.Begin(ctx, cl.Lease)
			if err != nil {
				t.Fatal(err)
			}
			if err := tx.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte(k)}); err != nil {
				t.Fatal(err)
			}
		}
		keys = append(keys, k)
	}
	return keys
}

// TestCleanerRunOnce: one sweep deletes every expired completed key in
// batches, reports progress batch by batch and its count to OnSweep, and
// leaves the live keys and the expired keys without a response (their
// attempt may have paid) however often it runs.
func TestCleanerRunOnce(t *testing.T) {
	clock := storetest.NewClock(time.Now())
	s := memstore.New(memstore.Options{Now: clock.Now})
	expired := fillKeys(t, s, "old", 7, time.Minute, true)
	unanswered := fillKeys(t, s, "unanswered", 2, time.Minute, false)
	clock.Advance(time.Hour) // the leases and the TTLs above ran out
	live := fillKeys(t, s, "live", 3, 24*time.Hour, true)

	var progress []int
	var swept []idem.CleanerStats
	c := idem.NewCleaner(s, idem.CleanerOptions{
		Batch:    3,
		Pause:    time.Millisecond,
		Progress: func(n int) { progress = append(progress, n) },
		OnSweep: func(_ context.Context, st idem.CleanerStats, err error) {
			if err != nil {
				t.Errorf("OnSweep err = %v", err)
			}
			swept = append(swept, st)
		},
	})
	n, err := c.RunOnce(context.Background())
	if err != nil || n != len(expired) {
		t.Fatalf("RunOnce = %d, %v; want %d", n, err, len(expired))
	}
	if got, want := fmt.Sprint(progress), "[3 6 7]"; got != want {
		t.Errorf("progress %s, want %s (after each batch of 3)", got, want)
	}
	if len(swept) != 1 || swept[0].Deleted != len(expired) {
		t.Errorf("OnSweep saw %+v, want one sweep of %d", swept, len(expired))
	}
	for _, k := range expired {
		if _, err := s.Get(context.Background(), "u", k); !errors.Is(err, idem.ErrNotFound) {
			t.Errorf("expired key %s: %v, want it deleted", k, err)
		}
	}
	// Again, much later: nothing more goes but what expired since.
	clock.Advance(48 * time.Hour)
	if n, err := c.RunOnce(context.Background()); err != nil || n != len(live) {
		t.Errorf("second RunOnce = %d, %v; want the %d keys that expired since", n, err, len(live))
	}
	for _, k := range unanswered {
		rec, err := s.Get(context.Background(), "u", k)
		if err != nil || rec.Response != nil {
			t.Errorf("key %s without a response: %+v, %v; want it kept", k, rec, err)
		}
	}
	if s.Len() != len(unanswered) {
		t.Errorf("%d records left, want the %d without a response", s.Len(), len(unanswered))
	}
}

// fastSweeper is a Sweeper with a faster way to clean (as pgstore).
type fastSweeper struct {
	mu      sync.Mutex
	cleaned []idemdriver.CleanParams
	deletes int
}

func (f *fastSweeper) Abandoned(context.Context, idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	return nil, nil
}

func (f *fastSweeper) DeleteExpired(context.Context, int) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.deletes++
	return 0, nil
}

func (f *fastSweeper) CleanExpired(_ context.Context, p idemdriver.CleanParams) (int, error) {
	f.mu.Lock()
	f.cleaned = append(f.cleaned, p)
	f.mu.Unlock()
	if p.Progress != nil {
		p.Progress(5)
		p.Progress(9)
	}
	return 9, nil
}

// TestCleanerUsesExpiredCleaner: a store that has a faster way
// (idemdriver.ExpiredCleaner) is swept with it, with the Cleaner's batches, and
// its DeleteExpired is not called.
func TestCleanerUsesExpiredCleaner(t *testing.T) {
	f := &fastSweeper{}
	var progress []int
	c := idem.NewCleaner(f, idem.CleanerOptions{Batch: 42, Pause: 7 * time.Millisecond, Progress: func(n int) { progress = append(progress, n) }})
	n, err := c.RunOnce(context.Background())
	if err != nil || n != 9 {
		t.Fatalf("RunOnce = %d, %v; want 9", n, err)
	}
	if f.deletes != 0 {
		t.Errorf("DeleteExpired called %d times, want CleanExpired alone", f.deletes)
	}
	if len(f.cleaned) != 1 || f.cleaned[0].Batch != 42 || f.cleaned[0].Pause != 7*time.Millisecond {
		t.Errorf("CleanExpired called with %+v, want once with Batch 42, Pause 7ms", f.cleaned)
	}
	if fmt.Sprint(progress) != "[5 9]" {
		t.Errorf("progress %v, want the store's [5 9]", progress)
	}
	// The defaults.
	if _, err := idem.NewCleaner(f, idem.CleanerOptions{}).RunOnce(context.Background()); err != nil {
		t.Fatalf("RunOnce: %v", err)
	}
	if p := f.cleaned[1]; p.Batch != idem.DefaultCleanBatch || p.Pause != idem.DefaultCleanPause || p.Progress != nil {
		t.Errorf("default params %+v, want Batch %d, Pause %v, no Progress", p, idem.DefaultCleanBatch, idem.DefaultCleanPause)
	}
}

// failingSweeper deletes full batches, then fails, or blocks on its
// context.
type failingSweeper struct {
	mu    sync.Mutex
	calls int
	fail  error // after the first batch
}

func (f *failingSweeper) Abandoned(context.Context, idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	return nil, nil
}

func (f *failingSweeper) DeleteExpired(ctx context.Context, limit int) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if f.calls > 1 && f.fail != nil {
		return 1, f.fail
	}
	return limit, ctx.Err()
}

// TestCleanerErrors: a failed batch ends the sweep with the count so
// far; a sweep cut by its context ends in the pause between batches.
func TestCleanerErrors(t *testing.T) {
	boom := errors.New("boom")
	f := &failingSweeper{fail: boom}
	n, err := idem.NewCleaner(f, idem.CleanerOptions{Batch: 10}).RunOnce(context.Background())
	if !errors.Is(err, boom) || n != 11 {
		t.Errorf("RunOnce = %d, %v; want 11 (a full batch, then 1 with the error), boom", n, err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	f = &failingSweeper{}
	c := idem.NewCleaner(f, idem.CleanerOptions{Batch: 10, Pause: time.Hour, Progress: func(int) { cancel() }})
	n, err = c.RunOnce(ctx)
	if !errors.Is(err, context.Canceled) || n != 10 || f.calls != 1 {
		t.Errorf("RunOnce = %d, %v after %d batches; want 10, context.Canceled after 1 (cut in the pause)", n, err, f.calls)
	}
}

// TestCleanerRun: Run sweeps at once and then every Interval, logs what
// the sweeps did (deleted keys, failures) and returns when its context is
// done; OnSweep sees every sweep and the time it took by Now.
func TestCleanerRun(t *testing.T) {
	var logs bytes.Buffer
	var mu sync.Mutex // guards logs
	logger := slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		return logs.Write(p)
	}), nil))
	boom := errors.New("boom")
	f := &failingSweeper{fail: boom}
	var ticks int
	now := func() time.Time { ticks++; return time.Unix(0, 0).Add(time.Duration(ticks) * time.Second) }
	sweeps := make(chan idem.CleanerStats, 10)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := idem.NewCleaner(f, idem.CleanerOptions{
		Interval: time.Millisecond, Batch: 4, Pause: time.Millisecond, Logger: logger, Now: now,
		OnSweep: func(_ context.Context, st idem.CleanerStats, _ error) { sweeps <- st },
	})
	done := make(chan struct{})
	go func() { defer close(done); c.Run(ctx) }()
	for i := range 2 {
		select {
		case st := <-sweeps:
			if st.Took != time.Second {
				t.Errorf("sweep %d took %v by Now, want 1s", i, st.Took)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("sweep %d did not happen", i)
		}
	}
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return when its context was done")
	}
	mu.Lock()
	out := logs.String()
	mu.Unlock()
	// The first sweep: a full batch, then 1 and boom; the second: boom
	// after 1.
	if !strings.Contains(out, `msg="idem: cleaner failed to delete expired keys" deleted=5 err=boom`) {
		t.Errorf("logs do not report the failed sweep:\n%s", out)
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// TestNoHTTPTestInProduction: the package's own files (not its tests)
// do not import net/http/httptest.
func TestNoHTTPTestInProduction(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		checked++
		for _, im := range f.Imports {
			if p, _ := strconv.Unquote(im.Path.Value); p == "net/http/httptest" {
				t.Errorf("%s imports net/http/httptest", name)
			}
		}
	}
	if checked == 0 {
		t.Fatal("no file checked")
	}
}
