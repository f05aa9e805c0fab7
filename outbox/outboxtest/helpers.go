package outboxtest

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"

	"github.com/idem-go/idem/outbox"
)

// migrateAll runs migrate(0..n-1) at once, then each again, failing t on
// any error.
// MigrateConcurrently runs migrate for n instances at once, twice, and
// fails t on any error: a table's Migrate is safe from several processes.
func MigrateConcurrently(t *testing.T, migrate func(i int) error, n int) {
	t.Helper()
	for round := range 2 {
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() { errs[i] = migrate(i) })
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Errorf("round %d, instance %d: Migrate: %v", round, i, err)
			}
		}
	}
}

// SlowBroker checks that a broker that does not answer holds a Take's
// locks for PublishTimeout only: the publish's ctx ends, the event stays
// unsent with one attempt counted, the events after it are left for the
// next pass (not attempted), and the next pass publishes them in order.
func SlowBroker(t *testing.T, tb outbox.Table, add func(...outbox.Event), attempts func(id string) int) {
	t.Helper()
	ctx := context.Background()
	add(outbox.Event{ID: "slow-1", Subject: "s", OrderingKey: "a"}, outbox.Event{ID: "other-1", Subject: "s", OrderingKey: "b"})
	n, err := tb.Take(ctx, 10, func(ctx context.Context, e outbox.Event) error {
		<-ctx.Done() // the broker never answers
		return ctx.Err()
	})
	if n != 0 || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Take with a broker that does not answer = %d, %v; want 0 and DeadlineExceeded", n, err)
	}
	if got := attempts("slow-1"); got != 1 {
		t.Errorf("slow-1: %d attempts, want 1", got)
	}
	if got := attempts("other-1"); got != 0 {
		t.Errorf("other-1: %d attempts, want 0 (left for the next pass)", got)
	}
	var got []string
	n, err = tb.Take(ctx, 10, func(_ context.Context, e outbox.Event) error { got = append(got, e.ID); return nil })
	if n != 2 || err != nil || fmt.Sprint(got) != "[slow-1 other-1]" {
		t.Fatalf("next Take = %d, %v, published %v; want 2, nil, [slow-1 other-1]", n, err, got)
	}
}

// BenchTake adds b.N events with addAll, 1000 a transaction, then takes
// them all and reports events/s.
func BenchTake(b *testing.B, tb outbox.Table, keys int, addAll func(context.Context, []outbox.Event) error) {
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

// MigrationFiles is the number of migrations of the table's package, run
// from its directory (its migrations/*.sql): each is recorded once when
// applied.
func MigrationFiles(t *testing.T) int {
	t.Helper()
	files, err := filepath.Glob("migrations/*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("migrations/*.sql: %v, %d files", err, len(files))
	}
	return len(files)
}
