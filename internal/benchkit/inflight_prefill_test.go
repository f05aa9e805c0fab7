package benchkit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// TestInflightGate holds one request per key in the handler of each
// store's target, with and without the middleware, and sends the same
// keys again while they are held: behind the middleware every repeat is
// answered 409 and inserts nothing; the bare handler answers 201. Once
// released, the held requests answer 201 and leave the handler.
func TestInflightGate(t *testing.T) {
	for _, store := range Stores {
		t.Run(store, func(t *testing.T) {
			for _, mw := range []bool{false, true} {
				tgt := NewForTest(t, store, mw)
				w := NewWorkload(Inflight, 2)
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
						codes[i] = benchDo(t, tgt, w, r).Code
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
					rec := benchDo(t, tgt, w, r)
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
				w2 := NewWorkload(Inflight, 1)
				if rec := benchDo(t, tgt, w2, w2.Held()[0]); rec.Code != http.StatusCreated {
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
	tgt := NewForTest(t, Memory, true)
	w := NewWorkload(Inflight, 1)
	w.Keys = 2
	reqs := w.Held()
	g := tgt.Hold(100 * time.Millisecond)
	start := time.Now()
	if rec := benchDo(t, tgt, w, reqs[0]); rec.Code != http.StatusCreated {
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
	req, err := w.HTTP("http://bench"+Path, reqs[1])
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
	other := NewForTest(t, Memory, false)
	g = other.Hold(time.Hour)
	req0, err := w.HTTP("http://bench"+Path, reqs[0])
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

// TestPrefillRows prefills the PostgreSQL table (and the one under Redis)
// in several batches and checks the rows: n live keys of prefill users,
// none of the workload's; a run's keys are then deleted by ResetKeys and
// the prefilled ones kept.
func TestPrefillRows(t *testing.T) {
	defer func(b int64) { prefillBatch = b }(prefillBatch)
	prefillBatch = 1000
	for _, store := range []string{Postgres, Redis} {
		t.Run(store, func(t *testing.T) {
			tgt := NewForTest(t, store, true)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			const n = 2345
			var calls []int64
			if err := tgt.Prefill(ctx, n, func(done int64) { calls = append(calls, done) }); err != nil {
				t.Fatal(err)
			}
			if want := []int64{1000, 2000, 2345}; len(calls) != 3 || calls[0] != want[0] || calls[1] != want[1] || calls[2] != want[2] {
				t.Errorf("progress %v, want %v", calls, want)
			}
			var total, live, users, distinctKeys int64
			err := tgt.pool.QueryRow(ctx, `SELECT count(*),
				count(*) FILTER (WHERE response_status = 201 AND response_body IS NOT NULL AND completed_at IS NOT NULL
					AND expires_at > now() + interval '1 hour' AND created_at <= now() AND user_id LIKE 'prefill-%'),
				count(DISTINCT user_id), count(DISTINCT key)
				FROM idempotency_keys`).Scan(&total, &live, &users, &distinctKeys)
			if err != nil {
				t.Fatal(err)
			}
			if total != n || live != n || distinctKeys != n || users != (n+99)/100 {
				t.Fatalf("%d rows, %d live prefill keys, %d users, %d distinct keys; want %d, %d, %d, %d", total, live, users, distinctKeys, n, n, (n+99)/100, n)
			}
			if got, err := tgt.PrefilledKeys(ctx); err != nil || got != n {
				t.Fatalf("PrefilledKeys = %d, %v", got, err)
			}
			if b, err := tgt.TableBytes(ctx); err != nil || b <= 0 {
				t.Fatalf("TableBytes = %d, %v", b, err)
			}
			// The workload's keys are its own: creates answer 201, and
			// ResetKeys deletes exactly them.
			w := NewWorkload(Create, 3)
			for range 5 {
				if rec := benchDo(t, tgt, w, w.Next()); rec.Code != http.StatusCreated || Replayed(rec.Header()) {
					t.Fatalf("create after prefill: %d %s", rec.Code, rec.Body)
				}
			}
			if _, err := tgt.ResetKeys(ctx, []string{"prefill-0000001"}); err == nil {
				t.Error("ResetKeys accepted a prefill user")
			}
			if del, err := tgt.ResetKeys(ctx, w.Users[:2]); err != nil || del != 4 {
				t.Fatalf("ResetKeys of two users deleted %d, %v; want 4", del, err)
			}
			if del, err := tgt.ResetKeys(ctx, w.Users); err != nil || del != 1 {
				t.Fatalf("ResetKeys deleted %d, %v; want the last 1", del, err)
			}
			if got, err := tgt.PrefilledKeys(ctx); err != nil || got != n {
				t.Fatalf("after ResetKeys, PrefilledKeys = %d, %v", got, err)
			}
			// CloseIdle leaves no connection open; the pool opens one
			// again when needed.
			if tgt.pool.Stat().TotalConns() == 0 {
				t.Fatal("no connection open before CloseIdle: the check below proves nothing")
			}
			tgt.CloseIdle()
			if c := tgt.pool.Stat().TotalConns(); c != 0 {
				t.Errorf("%d connections open after CloseIdle", c)
			}
			if got, err := tgt.PrefilledKeys(ctx); err != nil || got != n {
				t.Fatalf("after CloseIdle, PrefilledKeys = %d, %v", got, err)
			}
		})
	}
	// Memory and SQLite have no table to prefill.
	if err := NewForTest(t, Memory, true).Prefill(context.Background(), 10, nil); err == nil {
		t.Error("Prefill on the memory store did not fail")
	}
}
