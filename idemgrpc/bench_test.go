package idemgrpc_test

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idem-go/idem/idemgrpc"
	"github.com/idem-go/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"
)

// BenchmarkInterceptor is the interceptor's cost in process, as
// BenchmarkStoreMemory is the HTTP middleware's (docs/BENCHMARKS.md): the
// test service's Create over a bufconn, answered by a handler that records
// one row in a map, without the interceptor (bare) and with it on memstore
// (idem, the row written at the store's commit). create sends a fresh key
// each call, replay one key created before the timer; the same key goes
// to the bare server, which ignores it. ns/op and allocs/op of idem less
// bare's are what the interceptor adds; the client's and the transport's
// share is in both. Parallel runs from 32 goroutines.
//
//	go test -run '^$' -bench Interceptor -benchmem -count 6 ./idemgrpc/
func BenchmarkInterceptor(b *testing.B) {
	for _, parallel := range []bool{false, true} {
		name := "one"
		if parallel {
			name = "parallel"
		}
		b.Run(name, func(b *testing.B) { benchInterceptor(b, parallel) })
	}
}

func benchInterceptor(b *testing.B, parallel bool) {
	req, err := structpb.NewStruct(map[string]any{"sku": "sku_42", "quantity": 1, "currency": "EUR", "note": "benchmark"})
	if err != nil {
		b.Fatal(err)
	}
	answer, err := structpb.NewStruct(map[string]any{"id": "ord_0123456789abcdef", "status": "created"})
	if err != nil {
		b.Fatal(err)
	}
	var (
		mu   sync.Mutex
		rows = map[string]bool{}
		seq  atomic.Int64
	)
	record := func(key string) {
		mu.Lock()
		rows[key] = true
		mu.Unlock()
	}
	bare := &service{handle: func(ctx context.Context, _ *structpb.Struct) (*structpb.Struct, error) {
		record(strconv.FormatInt(seq.Add(1), 10))
		return answer, nil
	}}
	idem := &service{handle: func(ctx context.Context, _ *structpb.Struct) (*structpb.Struct, error) {
		tx, err := memstore.FromContext(ctx)
		if err != nil {
			return nil, err
		}
		key := strconv.FormatInt(seq.Add(1), 10)
		tx.OnCommit(func() { record(key) })
		return answer, nil
	}}
	conns := map[string]*grpc.ClientConn{
		"bare": serve(b, bare, nil),
		"idem": serve(b, idem, []grpc.UnaryServerInterceptor{
			idemgrpc.UnaryServerInterceptor(memstore.New(memstore.Options{}), testOptions()),
		}),
	}
	ctx := context.Background()
	for _, mode := range []string{"create", "replay"} {
		b.Run(mode, func(b *testing.B) {
			for _, name := range []string{"bare", "idem"} {
				conn := conns[name]
				b.Run(name, func(b *testing.B) {
					run := "bench-" + mode + "-" + name + "-" + strconv.FormatInt(seq.Add(1), 10) + "-"
					replayKey := run + "replayed"
					if mode == "replay" {
						if r := create(ctx, conn, replayKey, req); r.err != nil {
							b.Fatalf("first call: %v", r.err)
						}
					}
					call := func(i int64) bool {
						key := replayKey
						if mode == "create" {
							key = run + strconv.FormatInt(i, 10)
						}
						r := create(ctx, conn, key, req)
						if r.err != nil || (mode == "replay" && name == "idem" && !r.replayed()) {
							b.Errorf("key %s: %v (replayed %v)", key, r.err, r.replayed())
							return false
						}
						return true
					}
					b.ReportAllocs()
					b.ResetTimer()
					if !parallel {
						var i int64
						for b.Loop() {
							i++
							if !call(i) {
								b.FailNow()
							}
						}
						return
					}
					var n atomic.Int64
					b.SetParallelism(16)
					b.RunParallel(func(pb *testing.PB) {
						for pb.Next() {
							if !call(n.Add(1)) {
								return
							}
						}
					})
				})
			}
		})
	}
}
