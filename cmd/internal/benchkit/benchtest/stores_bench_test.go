package benchtest_test

// The library-alone benchmarks (docs/BENCHMARKS.md): the middleware on each
// store against the bare one-INSERT handler, side by side in one run. The
// sub-benchmarks are benchtest.Benchmark's. Run with
//
//	go test -run '^$' -bench . -benchmem -count 5 ./cmd/internal/benchkit/
//
// PostgreSQL and Redis need TEST_DATABASE_URL and TEST_REDIS_URL.

import (
	"testing"

	"github.com/idem-go/idem/cmd/internal/benchkit"
	"github.com/idem-go/idem/cmd/internal/benchkit/benchtest"
)

// BenchmarkBmMemory gives the "added over the bare handler" figures of the
// memory store: idem ns/op and allocs/op less bare's, create and replay.
func BenchmarkBmMemory(b *testing.B) { benchtest.Benchmark(b, benchkit.Memory, false) }

// BenchmarkBmMemoryParallel is BenchmarkBmMemory from 32 goroutines.
func BenchmarkBmMemoryParallel(b *testing.B) { benchtest.Benchmark(b, benchkit.Memory, true) }

// BenchmarkBmSQLite is the middleware on sqlitestore against the bare
// handler writing to the same kind of file, one request at a time.
func BenchmarkBmSQLite(b *testing.B) { benchtest.Benchmark(b, benchkit.SQLite, false) }

// BenchmarkBmSQLiteParallel is BenchmarkBmSQLite from 32 goroutines.
func BenchmarkBmSQLiteParallel(b *testing.B) { benchtest.Benchmark(b, benchkit.SQLite, true) }

// BenchmarkBmPostgres is the middleware on pgstore against the bare
// handler (one autocommit INSERT), one request at a time: the ratio
// bare ns/op ÷ idem ns/op is the latency ratio of one client.
func BenchmarkBmPostgres(b *testing.B) { benchtest.Benchmark(b, benchkit.Postgres, false) }

// BenchmarkBmPostgresParallel is BenchmarkBmPostgres from 32 goroutines
// on a pool of 16 connections: bare ns/op ÷ idem ns/op is the issue's
// throughput ratio (create ÷ no middleware, replay ÷ no middleware).
func BenchmarkBmPostgresParallel(b *testing.B) { benchtest.Benchmark(b, benchkit.Postgres, true) }

// BenchmarkBmRedis is the middleware on redisfront in front of pgstore
// against the bare handler (one autocommit INSERT in PostgreSQL), one
// request at a time.
func BenchmarkBmRedis(b *testing.B) { benchtest.Benchmark(b, benchkit.Redis, false) }

// BenchmarkBmRedisParallel is BenchmarkBmRedis from 32 goroutines: its
// create/idem against BenchmarkBmPostgresParallel's is the issue's
// "Redis in front, create ÷ PostgreSQL-alone create", and bare ÷ idem of
// replay its "Redis in front, replay ÷ no middleware".
func BenchmarkBmRedisParallel(b *testing.B) { benchtest.Benchmark(b, benchkit.Redis, true) }

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
