package outbox_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/outbox"
)

// BenchmarkTake measures the relay's side of the outbox: b.N events,
// added beforehand (untimed), go through Take with a publisher that does
// nothing, Batch events per Take, and the figure is events/s. The keys
// case says how many ordering keys the events spread over: "distinct"
// (every event its own key, as with many users) fills every batch;
// with fewer keys than the batch a Take sends one event per key.
func BenchmarkTake(b *testing.B) {
	for _, keys := range []int{0, 10} {
		name := "keys=distinct"
		if keys > 0 {
			name = fmt.Sprintf("keys=%d", keys)
		}
		b.Run("sqlite/"+name, func(b *testing.B) {
			tb, db, _ := sqliteTable(b)
			benchTake(b, tb, keys, func(ctx context.Context, es []outbox.Event) error {
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					return err
				}
				defer tx.Rollback()
				for _, e := range es {
					if err := tb.Add(ctx, tx, e); err != nil {
						return err
					}
				}
				return tx.Commit()
			})
		})
		b.Run("postgres/"+name, func(b *testing.B) {
			tb, pool := pgTable(b)
			benchTake(b, tb, keys, func(ctx context.Context, es []outbox.Event) error {
				return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					for _, e := range es {
						if err := tb.Add(ctx, tx, e); err != nil {
							return err
						}
					}
					return nil
				})
			})
		})
	}
}

// benchTake adds b.N events with addAll, 1000 a transaction, then takes
// them all and reports events/s.
func benchTake(b *testing.B, tb outbox.Table, keys int, addAll func(context.Context, []outbox.Event) error) {
	ctx := context.Background()
	const perTx = 1000
	body := []byte(`{"id":"ord_0123456789abcdef01234567","user_id":"user-1","items":[{"sku":"SKU-1","quantity":2,"unit_price":1299}],"total":2598,"currency":"EUR"}`)
	var es []outbox.Event
	for i := range b.N {
		key := fmt.Sprintf("user-%d", i)
		if keys > 0 {
			key = fmt.Sprintf("user-%d", i%keys)
		}
		es = append(es, outbox.Event{ID: fmt.Sprintf("evt_%d", i), Subject: "orders.created", OrderingKey: key, Body: body})
		if len(es) == perTx || i == b.N-1 {
			if err := addAll(ctx, es); err != nil {
				b.Fatal(err)
			}
			es = es[:0]
		}
	}
	noop := func(context.Context, outbox.Event) error { return nil }
	b.ResetTimer()
	sent := 0
	for sent < b.N {
		n, err := tb.Take(ctx, outbox.DefaultBatch, noop)
		if err != nil {
			b.Fatal(err)
		}
		if n == 0 {
			b.Fatalf("Take sent nothing with %d of %d events left", b.N-sent, b.N)
		}
		sent += n
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "events/s")
}
