package benchtest

import (
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idem-go/idem/cmd/internal/benchkit"
)

// benchBody is the request body of every benchmark request.
const benchBody = `{"sku":"sku_42","quantity":1,"currency":"EUR","note":"benchmark"}`

// benchSeq numbers the keys of one process, so that every create is new.
var benchSeq atomic.Int64

// benchServe sends one POST with key to h and fails b unless it answered
// 201 (replayed, when replay is set).
func benchServe(b *testing.B, h http.Handler, key string, replay bool) bool {
	r := httptest.NewRequest(http.MethodPost, benchkit.Path, strings.NewReader(benchBody))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("Idempotency-Key", key)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusCreated || (replay && !benchkit.Replayed(w.Header())) {
		b.Errorf("key %s: status %d, Idempotent-Replayed %q: %s", key, w.Code, w.Header().Get("Idempotent-Replayed"), w.Body)
		return false
	}
	return true
}

// Benchmark is the store benchmarks of issue 11, point 1: the middleware
// on store against the bare one-INSERT handler, side by side in one run.
// Sub-benchmarks: create/bare and create/idem (a fresh key each
// iteration), replay/bare and replay/idem (one key created before the
// timer); the same requests, the key included, reach the bare handler,
// which ignores the key. One request at a time or, with parallel, from 32
// goroutines (16 per GOMAXPROCS on 2 cores), so that bare ns/op ÷ idem
// ns/op is a throughput ratio. The targets come from NewForTest (skipped
// without the servers they need, unless CI=true).
func Benchmark(b *testing.B, store string, parallel bool) {
	run(b, store, parallel, NewForTest(b, store, false), NewForTest(b, store, true))
}

// BenchmarkPrefilled is Benchmark on the memory store (benchkit.Memory)
// holding n completed records more behind the middleware
// (Target.PrefillMemory), put there before the timer: the middleware's
// added cost with a large store, where every garbage collection sees
// those records, to set against Benchmark's with a small one.
func BenchmarkPrefilled(b *testing.B, store string, parallel bool, n int) {
	idem := NewForTest(b, store, true)
	if err := idem.PrefillMemory(b.Context(), n); err != nil {
		b.Fatal(err)
	}
	runtime.GC()
	run(b, store, parallel, NewForTest(b, store, false), idem)
}

// run is Benchmark on the targets bare and idem.
func run(b *testing.B, store string, parallel bool, bare, idem *benchkit.Target) {
	hs := map[string]http.Handler{"bare": bare.Handler(), "idem": idem.Handler()}
	for _, mode := range []string{"create", "replay"} {
		b.Run(mode, func(b *testing.B) {
			for _, name := range []string{"bare", "idem"} {
				h := hs[name]
				b.Run(name, func(b *testing.B) {
					run := "bm-" + store + "-" + mode + "-" + strconv.FormatInt(benchSeq.Add(1), 10) + "-"
					replayKey := run + "replayed"
					if mode == "replay" && !benchServe(b, h, replayKey, false) {
						b.FailNow()
					}
					replay := mode == "replay" && name == "idem"
					key := func() string {
						if mode == "replay" {
							return replayKey
						}
						return run + strconv.FormatInt(benchSeq.Add(1), 10)
					}
					b.ReportAllocs()
					b.ResetTimer()
					if !parallel {
						for b.Loop() {
							if !benchServe(b, h, key(), replay) {
								b.FailNow()
							}
						}
						return
					}
					b.SetParallelism(16)
					b.RunParallel(func(pb *testing.PB) {
						for pb.Next() {
							if !benchServe(b, h, key(), replay) {
								return
							}
						}
					})
				})
			}
		})
	}
}
