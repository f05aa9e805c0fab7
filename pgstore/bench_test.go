package pgstore_test

// Benchmarks of issue 11, point 1: the middleware on pgstore against the
// bare one-INSERT handler (internal/benchkit), side by side in one run.
// The sub-benchmarks are benchkit.Benchmark's. Run with
//
//	go test -run '^$' -bench . -benchmem -count 5 ./pgstore/
//
// (see docs/BENCHMARKS.md).

import (
	"testing"

	"github.com/idem-go/idem/internal/benchkit"
)

// BenchmarkBmPostgres is the middleware on pgstore against the bare
// handler (one autocommit INSERT), one request at a time: the ratio
// bare ns/op ÷ idem ns/op is the latency ratio of one client.
func BenchmarkBmPostgres(b *testing.B) { benchkit.Benchmark(b, benchkit.Postgres, false) }

// BenchmarkBmPostgresParallel is BenchmarkBmPostgres from 32 goroutines
// on a pool of 16 connections: bare ns/op ÷ idem ns/op is the issue's
// throughput ratio (create ÷ no middleware, replay ÷ no middleware).
func BenchmarkBmPostgresParallel(b *testing.B) { benchkit.Benchmark(b, benchkit.Postgres, true) }
