package benchtest_test

// The library-alone benchmarks (docs/BENCHMARKS.md): the middleware on each
// store against the bare one-INSERT handler, side by side in one run. The
// sub-benchmarks are benchtest.Benchmark's. Run with
//
//	go test -run '^$' -bench . -benchmem -count 5 ./cmd/internal/benchkit/benchtest/
//
// PostgreSQL and Redis need TEST_DATABASE_URL and TEST_REDIS_URL.

import (
	"testing"

	"github.com/idem-go/idem/cmd/internal/benchkit"
	"github.com/idem-go/idem/cmd/internal/benchkit/benchtest"
)

// BenchmarkStoreMemory gives the "added over the bare handler" figures of the
// memory store: idem ns/op and allocs/op less bare's, create and replay.
func BenchmarkStoreMemory(b *testing.B) { benchtest.Benchmark(b, benchkit.Memory, false) }

// BenchmarkStoreMemoryPrefilled is BenchmarkStoreMemory with 1,000,000
// completed records in the store behind the middleware: set against
// BenchmarkStoreMemory's figures, what the store's size adds (run it on
// its own, -bench 'BenchmarkStoreMemoryPrefilled$': the prefill takes a
// few seconds and about half a gigabyte).
func BenchmarkStoreMemoryPrefilled(b *testing.B) {
	benchtest.BenchmarkPrefilled(b, benchkit.Memory, false, 1_000_000)
}

// BenchmarkStoreMemoryParallel is BenchmarkStoreMemory from 32 goroutines.
func BenchmarkStoreMemoryParallel(b *testing.B) { benchtest.Benchmark(b, benchkit.Memory, true) }

// BenchmarkStoreSQLite is the middleware on sqlitestore against the bare
// handler writing to the same kind of file, one request at a time.
func BenchmarkStoreSQLite(b *testing.B) { benchtest.Benchmark(b, benchkit.SQLite, false) }

// BenchmarkStoreSQLiteParallel is BenchmarkStoreSQLite from 32 goroutines.
func BenchmarkStoreSQLiteParallel(b *testing.B) { benchtest.Benchmark(b, benchkit.SQLite, true) }

// BenchmarkStorePostgres is the middleware on pgstore against the bare
// handler (one autocommit INSERT), one request at a time: the ratio
// bare ns/op ÷ idem ns/op is the latency ratio of one client.
func BenchmarkStorePostgres(b *testing.B) { benchtest.Benchmark(b, benchkit.Postgres, false) }

// BenchmarkStorePostgresParallel is BenchmarkStorePostgres from 32 goroutines
// on a pool of 16 connections: bare ns/op ÷ idem ns/op is the issue's
// throughput ratio (create ÷ no middleware, replay ÷ no middleware).
func BenchmarkStorePostgresParallel(b *testing.B) { benchtest.Benchmark(b, benchkit.Postgres, true) }

// BenchmarkStoreRedis is the middleware on redisfront in front of pgstore
// against the bare handler (one autocommit INSERT in PostgreSQL), one
// request at a time.
func BenchmarkStoreRedis(b *testing.B) { benchtest.Benchmark(b, benchkit.Redis, false) }

// BenchmarkStoreRedisParallel is BenchmarkStoreRedis from 32 goroutines: its
// create/idem against BenchmarkStorePostgresParallel's is the issue's
// "Redis in front, create ÷ PostgreSQL-alone create", and bare ÷ idem of
// replay its "Redis in front, replay ÷ no middleware".
func BenchmarkStoreRedisParallel(b *testing.B) { benchtest.Benchmark(b, benchkit.Redis, true) }

// Counting tests (issue 11, point 3) through redisfront in front of
// pgstore: PostgreSQL statements, round trips and commits, and Redis
// commands and round trips, of one create, one replay and one in-flight
// 409, each on connections that already ran the same statements and
// scripts. The asserted figures are today's: a create is three Redis
// scripts (claim, lease lock, end with the cached answer) around
// pgstore's five statements in three round trips; a replay and a 409 are
// one Redis script and nothing in PostgreSQL. An optimisation that lowers
// them must lower the assertion; a change that raises them fails here, in
// CI.
