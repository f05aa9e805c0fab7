package benchtest

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"

	"github.com/idem-go/idem/cmd/internal/benchkit"
)

func benchRows(tb testing.TB, t *benchkit.Target) int64 {
	tb.Helper()
	n, err := t.Rows(context.Background())
	if err != nil {
		tb.Fatal(err)
	}
	return n
}

// TestBenchTargetModes checks, on each store, what each mode does to the
// rows with and without the middleware: the counts, not the time.
func TestBenchTargetModes(t *testing.T) {
	for _, store := range benchkit.Stores {
		t.Run(store, func(t *testing.T) {
			for _, mw := range []bool{false, true} {
				tgt := NewForTest(t, store, mw)
				const n = 12

				// benchkit.Create: every request inserts one row and answers 201
				// with a JSON body of about 200 bytes.
				w := benchkit.NewWorkload(benchkit.Create, 3)
				for range n {
					rec := Do(t, tgt, w, w.Next())
					if rec.Code != http.StatusCreated || benchkit.Replayed(rec.Header()) {
						t.Fatalf("mw=%v create: %d replayed=%v %s", mw, rec.Code, benchkit.Replayed(rec.Header()), rec.Body)
					}
					var body map[string]any
					if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
						t.Fatalf("create body %q: %v", rec.Body, err)
					}
					if l := rec.Body.Len(); l < 150 || l > 260 {
						t.Errorf("create body is %d bytes, want about 200: %s", l, rec.Body)
					}
				}
				if got := benchRows(t, tgt); got != n {
					t.Fatalf("mw=%v: %d rows after %d creates", mw, got, n)
				}

				// benchkit.Replay: the warm-up creates Keys rows; then behind the
				// middleware every request is a replay and inserts nothing,
				// while the bare handler inserts each time.
				w = benchkit.NewWorkload(benchkit.Replay, 2)
				w.Keys = 4
				for _, r := range w.Warmup() {
					if rec := Do(t, tgt, w, r); rec.Code != http.StatusCreated {
						t.Fatalf("warm-up: %d %s", rec.Code, rec.Body)
					}
				}
				replays := 0
				for range n {
					rec := Do(t, tgt, w, w.Next())
					if rec.Code != http.StatusCreated {
						t.Fatalf("replay: %d %s", rec.Code, rec.Body)
					}
					if benchkit.Replayed(rec.Header()) {
						replays++
					}
				}
				want := int64(n + 4 + n)
				if mw {
					want = int64(n + 4)
					if replays != n {
						t.Errorf("behind the middleware %d of %d replay requests were replays", replays, n)
					}
				} else if replays != 0 {
					t.Errorf("the bare handler answered %d replays", replays)
				}
				if got := benchRows(t, tgt); got != want {
					t.Fatalf("mw=%v: %d rows after replay mode, want %d", mw, got, want)
				}

				// benchkit.Duplicates, sent one after the other here: each key runs
				// once behind the middleware.
				w = benchkit.NewWorkload(benchkit.Duplicates, 1)
				w.Copies = 3
				for range 3 * 4 {
					if rec := Do(t, tgt, w, w.Next()); rec.Code != http.StatusCreated {
						t.Fatalf("duplicates: %d %s", rec.Code, rec.Body)
					}
				}
				if mw {
					want += 4
				} else {
					want += 12
				}
				if got := benchRows(t, tgt); got != want {
					t.Fatalf("mw=%v: %d rows after duplicates, want %d", mw, got, want)
				}

				// benchkit.NoKey: passes through the middleware, unprotected.
				w = benchkit.NewWorkload(benchkit.NoKey, 2)
				for range 5 {
					r := w.Next()
					if r.Key != "" {
						t.Fatalf("nokey request with key %q", r.Key)
					}
					if rec := Do(t, tgt, w, r); rec.Code != http.StatusCreated {
						t.Fatalf("nokey: %d %s", rec.Code, rec.Body)
					}
				}
				if got := benchRows(t, tgt); got != want+5 {
					t.Fatalf("mw=%v: %d rows after nokey, want %d", mw, got, want+5)
				}
			}
		})
	}
}

// TestBenchWorkloadKeys checks the keys each mode hands out.
func TestBenchWorkloadKeys(t *testing.T) {
	w := benchkit.NewWorkload(benchkit.Duplicates, 2)
	w.Copies = 3
	seen := map[string]int{}
	users := map[string]string{}
	for range 30 {
		r := w.Next()
		seen[r.Key]++
		if u, ok := users[r.Key]; ok && u != r.User {
			t.Fatalf("key %s sent as %s and %s", r.Key, u, r.User)
		}
		users[r.Key] = r.User
	}
	if len(seen) != 10 {
		t.Fatalf("%d keys in 30 duplicates of 3", len(seen))
	}
	for k, c := range seen {
		if c != 3 {
			t.Fatalf("key %s sent %d times", k, c)
		}
	}
	c := benchkit.NewWorkload(benchkit.Create, 4)
	keys := map[string]bool{}
	for range 100 {
		keys[c.Next().Key] = true
	}
	if len(keys) != 100 {
		t.Fatalf("create: %d distinct keys in 100", len(keys))
	}
	if k := benchkit.NewWorkload(benchkit.Create, 1).Next().Key; keys[k] {
		t.Fatalf("two workloads share key %s", k)
	}
	r := benchkit.NewWorkload(benchkit.Replay, 3)
	r.Keys = 5
	warm := map[string]bool{}
	for _, q := range r.Warmup() {
		warm[q.Key] = true
	}
	for range 20 {
		if q := r.Next(); !warm[q.Key] {
			t.Fatalf("replay key %s not made by the warm-up", q.Key)
		}
	}
	if _, err := benchkit.ParseMode("bogus"); err == nil {
		t.Fatal("ParseMode accepted bogus")
	}
}
