package pgstore_test

// Benchmarks of issue 11, point 1: the middleware on pgstore against the
// bare one-INSERT handler (internal/benchkit), side by side in one run.
// Sub-benchmarks: create/bare and create/idem (a fresh key each
// iteration), replay/bare and replay/idem (one key created before the
// timer); the same requests, the key included, reach the bare handler,
// which ignores the key. Run with
//
//	go test -run '^$' -bench . -benchmem -count 5 ./pgstore/
//
// (see docs/BENCHMARKS.md).

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idem-go/idem/internal/benchkit"
)

// bmBody is the request body of every benchmark request.
const bmBody = `{"sku":"sku_42","quantity":1,"currency":"EUR","note":"benchmark"}`

// bmSeq numbers the keys of one process, so that every create is new.
var bmSeq atomic.Int64

// bmKey returns a fresh key.
func bmKey(run string) string {
	return run + strconv.FormatInt(bmSeq.Add(1), 10)
}

// bmServe sends one POST with key to h and fails b unless it answered 201
// (replayed, when replay is set).
func bmServe(b *testing.B, h http.Handler, key string, replay bool) bool {
	r := httptest.NewRequest(http.MethodPost, benchkit.Path, strings.NewReader(bmBody))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("Idempotency-Key", key)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusCreated || (replay && w.Header().Get("Idempotent-Replayed") != "true") {
		b.Errorf("key %s: status %d, Idempotent-Replayed %q: %s", key, w.Code, w.Header().Get("Idempotent-Replayed"), w.Body)
		return false
	}
	return true
}

// bmTargets builds the bare and the idem target of store once per
// top-level benchmark and closes them when it ends.
func bmTargets(b *testing.B, store string) map[string]http.Handler {
	b.Helper()
	if os.Getenv("TEST_DATABASE_URL") == "" {
		b.Skip("PostgreSQL benchmarks skipped: set TEST_DATABASE_URL (e.g. postgres://root@127.0.0.1:5432/test)")
	}
	hs := map[string]http.Handler{}
	for _, mw := range []bool{false, true} {
		t, err := benchkit.New(context.Background(), benchkit.Config{
			Store: store, Middleware: mw,
			DatabaseURL: os.Getenv("TEST_DATABASE_URL"), RedisURL: os.Getenv("TEST_REDIS_URL"),
		})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() {
			if err := t.Close(); err != nil {
				b.Errorf("closing the %s target: %v", store, err)
			}
		})
		name := "bare"
		if mw {
			name = "idem"
		}
		hs[name] = t.Handler()
	}
	return hs
}

// bmStore runs create and replay, bare and idem, one request at a time
// or, with parallel, from 32 goroutines (16 per GOMAXPROCS on 2 cores).
func bmStore(b *testing.B, store string, parallel bool) {
	hs := bmTargets(b, store)
	for _, mode := range []string{"create", "replay"} {
		b.Run(mode, func(b *testing.B) {
			for _, name := range []string{"bare", "idem"} {
				h := hs[name]
				b.Run(name, func(b *testing.B) {
					run := "bm-" + store + "-" + mode + "-" + strconv.FormatInt(bmSeq.Add(1), 10) + "-"
					replayKey := run + "replayed"
					if mode == "replay" && !bmServe(b, h, replayKey, false) {
						b.FailNow()
					}
					replay := mode == "replay" && name == "idem"
					key := func() string {
						if mode == "replay" {
							return replayKey
						}
						return bmKey(run)
					}
					b.ReportAllocs()
					b.ResetTimer()
					if !parallel {
						for b.Loop() {
							if !bmServe(b, h, key(), replay) {
								b.FailNow()
							}
						}
						return
					}
					b.SetParallelism(16)
					b.RunParallel(func(pb *testing.PB) {
						for pb.Next() {
							if !bmServe(b, h, key(), replay) {
								return
							}
						}
					})
				})
			}
		})
	}
}

// BenchmarkBmPostgres is the middleware on pgstore against the bare
// handler (one autocommit INSERT), one request at a time: the ratio
// bare ns/op ÷ idem ns/op is the latency ratio of one client.
func BenchmarkBmPostgres(b *testing.B) { bmStore(b, benchkit.Postgres, false) }

// BenchmarkBmPostgresParallel is BenchmarkBmPostgres from 32 goroutines
// on a pool of 16 connections: bare ns/op ÷ idem ns/op is the issue's
// throughput ratio (create ÷ no middleware, replay ÷ no middleware).
func BenchmarkBmPostgresParallel(b *testing.B) { bmStore(b, benchkit.Postgres, true) }
