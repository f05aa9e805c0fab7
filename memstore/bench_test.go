package memstore_test

// Benchmarks of issue 11, point 1: the middleware on memstore against the
// bare one-INSERT handler (internal/benchkit), side by side in one run.
// The sub-benchmarks are benchkit.Benchmark's. Run with
//
//	go test -run '^$' -bench . -benchmem -count 5 ./memstore/
//
// (see docs/BENCHMARKS.md).

import (
	"testing"

	"github.com/idem-go/idem/internal/benchkit"
)

// BenchmarkBmMemory gives the "added over the bare handler" figures of the
// memory store: idem ns/op and allocs/op less bare's, create and replay.
func BenchmarkBmMemory(b *testing.B) { benchkit.Benchmark(b, benchkit.Memory, false) }

// BenchmarkBmMemoryParallel is BenchmarkBmMemory from 32 goroutines.
func BenchmarkBmMemoryParallel(b *testing.B) { benchkit.Benchmark(b, benchkit.Memory, true) }
