package idem_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

// BenchmarkDo is idem.Do on memstore: a new key run (claim, Begin,
// Complete with a write through the operation's transaction) and a
// repeat answered from the store, with the body of the middleware's
// counted requests as input.
func BenchmarkDo(b *testing.B) {
	ctx := context.Background()
	store := memstore.New(memstore.Options{})
	fn := func(ctx context.Context, input []byte) ([]byte, error) {
		tx, err := memstore.FromContext(ctx)
		if err != nil {
			return nil, err
		}
		tx.OnCommit(func() {})
		return input, nil
	}
	p := idem.DoParams{User: "bench", Operation: "bench.apply", Input: []byte(allocsBody)}
	b.Run("run", func(b *testing.B) {
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			i++
			p.Key = "run-" + strconv.Itoa(i)
			if res, err := idem.Do(ctx, store, p, fn); err != nil || res.Replayed {
				b.Fatalf("Do = %+v, %v", res, err)
			}
		}
	})
	b.Run("replay", func(b *testing.B) {
		p.Key = "replayed"
		if _, err := idem.Do(ctx, store, p, fn); err != nil {
			b.Fatal(err)
		}
		b.ReportAllocs()
		for b.Loop() {
			if res, err := idem.Do(ctx, store, p, fn); err != nil || !res.Replayed {
				b.Fatalf("Do = %+v, %v", res, err)
			}
		}
	})
}
