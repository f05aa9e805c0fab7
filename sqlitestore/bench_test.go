package sqlitestore_test

// Benchmarks of issue 11, point 1: the middleware on sqlitestore against the
// bare one-INSERT handler (internal/benchkit), side by side in one run.
// The sub-benchmarks are benchkit.Benchmark's. Run with
//
//	go test -run '^$' -bench . -benchmem -count 5 ./sqlitestore/
//
// (see docs/BENCHMARKS.md).

import (
	"testing"

	"github.com/idem-go/idem/internal/benchkit"
)

// BenchmarkBmSQLite is the middleware on sqlitestore against the bare
// handler writing to the same kind of file, one request at a time.
func BenchmarkBmSQLite(b *testing.B) { benchkit.Benchmark(b, benchkit.SQLite, false) }

// BenchmarkBmSQLiteParallel is BenchmarkBmSQLite from 32 goroutines.
func BenchmarkBmSQLiteParallel(b *testing.B) { benchkit.Benchmark(b, benchkit.SQLite, true) }
