package benchtest

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/benchkit"
)

// TestInflightGate holds one request per key in the handler of each
// store's target, with and without the middleware, and sends the same
// keys again while they are held: behind the middleware every repeat is
// answered 409 and inserts nothing; the bare handler answers 201. Once
// released, the held requests answer 201 and leave the handler.
func TestInflightGate(t *testing.T) {
	for _, store := range benchkit.Stores {
		t.Run(store, func(t *testing.T) {
			for _, mw := range []bool{false, true} {
				tgt := NewForTest(t, store, mw)
				w := benchkit.NewWorkload(benchkit.Inflight, 2)
				w.Keys = 4
				held := w.Held()
				if len(held) != 4 {
					t.Fatalf("%d held requests, want 4", len(held))
				}
				g := tgt.Hold(time.Minute)
				codes := make([]int, len(held))
				var wg sync.WaitGroup
				for i, r := range held {
					if !r.Hold {
						t.Fatalf("held request %d without Hold", i)
					}
					wg.Add(1)
					go func() {
						defer wg.Done()
						codes[i] = Do(t, tgt, w, r).Code
					}()
				}
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				if err := g.WaitEntered(ctx, 4); err != nil {
					t.Fatalf("mw=%v: %d of 4 entered: %v", mw, g.Entered(), err)
				}
				cancel()
				keys := map[string]bool{}
				for _, r := range held {
					keys[r.Key] = true
				}
				const repeats = 12
				for range repeats {
					r := w.Next()
					if !keys[r.Key] || r.Hold {
						t.Fatalf("measured request %+v: not a repeat of a held key", r)
					}
					rec := Do(t, tgt, w, r)
					want := http.StatusCreated
					if mw {
						want = http.StatusConflict
					}
					if rec.Code != want {
						t.Fatalf("mw=%v: repeat of held key %s: %d, want %d: %s", mw, r.Key, rec.Code, want, rec.Body)
					}
				}
				if got := g.Inside(); got != 4 {
					t.Fatalf("mw=%v: %d held, want 4", mw, got)
				}
				if n := benchRows(t, tgt); mw && n != 0 || !mw && n != repeats {
					t.Fatalf("mw=%v: %d rows while held", mw, n)
				}
				g.Release()
				wg.Wait()
				ctx, cancel = context.WithTimeout(context.Background(), 30*time.Second)
				if err := g.WaitEmpty(ctx); err != nil {
					t.Fatalf("after release %d still held: %v", g.Inside(), err)
				}
				cancel()
				for i, c := range codes {
					if c != http.StatusCreated {
						t.Errorf("mw=%v: held request %d answered %d", mw, i, c)
					}
				}
				want := int64(4)
				if !mw {
					want += repeats
				}
				if n := benchRows(t, tgt); n != want {
					t.Errorf("mw=%v: %d rows after release, want %d", mw, n, want)
				}
				// The gate is closed: a request with HoldHeader goes through.
				w2 := benchkit.NewWorkload(benchkit.Inflight, 1)
				if rec := Do(t, tgt, w2, w2.Held()[0]); rec.Code != http.StatusCreated {
					t.Errorf("mw=%v: after release a held request answered %d", mw, rec.Code)
				}
			}
		})
	}
}

// TestInflightGateBounded checks that a gate nobody releases lets its
// requests go after its bound, that a request whose client goes away
// leaves it, and that Close releases an open gate.
func TestInflightGateBounded(t *testing.T) {
	tgt := NewForTest(t, benchkit.Memory, true)
	w := benchkit.NewWorkload(benchkit.Inflight, 1)
	w.Keys = 2
	reqs := w.Held()
	g := tgt.Hold(100 * time.Millisecond)
	start := time.Now()
	if rec := Do(t, tgt, w, reqs[0]); rec.Code != http.StatusCreated {
		t.Fatalf("bounded hold: %d %s", rec.Code, rec.Body)
	}
	if el := time.Since(start); el < 100*time.Millisecond {
		t.Errorf("held for %s, less than the bound", el)
	}
	if g.Entered() != 1 || g.Inside() != 0 {
		t.Errorf("entered %d, inside %d; want 1 and 0", g.Entered(), g.Inside())
	}

	// A client that goes away takes its request out of the gate.
	g = tgt.Hold(time.Hour)
	req, err := w.HTTP("http://bench"+benchkit.Path, reqs[1])
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int)
	go func() {
		rec := httptest.NewRecorder()
		tgt.Handler().ServeHTTP(rec, req.WithContext(ctx))
		done <- rec.Code
	}()
	wctx, wcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer wcancel()
	if err := g.WaitEntered(wctx, 1); err != nil {
		t.Fatal(err)
	}
	cancel()
	<-done
	if err := g.WaitEmpty(wctx); err != nil {
		t.Fatalf("a cancelled request stayed in the gate: %v", err)
	}

	// Close releases the open gate.
	other := NewForTest(t, benchkit.Memory, false)
	g = other.Hold(time.Hour)
	req0, err := w.HTTP("http://bench"+benchkit.Path, reqs[0])
	if err != nil {
		t.Fatal(err)
	}
	closed := make(chan int)
	go func() {
		rec := httptest.NewRecorder()
		other.Handler().ServeHTTP(rec, req0)
		closed <- rec.Code
	}()
	if err := g.WaitEntered(wctx, 1); err != nil {
		t.Fatal(err)
	}
	if err := other.Close(); err != nil {
		t.Fatal(err)
	}
	if err := g.WaitEmpty(wctx); err != nil {
		t.Fatalf("Close left a request in the gate: %v", err)
	}
	<-closed
}
