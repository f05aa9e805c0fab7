package orders

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/outbox"
)

type backfiller interface {
	BackfillEvents(ctx context.Context, batch int, progress func(added int)) (int, error)
}

// unmarkOrders clears every order's event_added, as on a database migrated
// from a version without it: with events deleted beside it, the orders are
// those of a database written before events, or by an older binary.
const unmarkOrders = `UPDATE orders SET event_added = NULL`

// TestBackfillEvents: orders without their event (written before the
// service wrote events) get it from BackfillEvents, in batches, the event
// EventFor makes of the order read back; the orders that have one keep it;
// four callers at once add each missing event once, without an error.
func TestBackfillEvents(t *testing.T) {
	for name, open := range repoEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			bf := e.repo.(backfiller)
			at := time.Date(2026, 3, 4, 5, 6, 7, 123456789, time.UTC)
			const n = 25
			for i := range n {
				o := &Order{
					ID: fmt.Sprintf("ord_%024x", i), UserID: fmt.Sprintf("user-%d", i%3), Status: StatusPaid,
					Items: []Item{{SKU: "A", Quantity: 1, UnitPrice: 100 + int64(i)}}, Total: 100 + int64(i), Currency: "EUR",
					PaymentID: fmt.Sprintf("pi_%d", i), CreatedAt: at.Add(time.Duration(i) * time.Second),
				}
				if err := e.repo.Create(ctx, o); err != nil {
					t.Fatal(err)
				}
			}
			kept := allEvents(t, e.table)
			if len(kept) != n {
				t.Fatalf("%d events, want %d", len(kept), n)
			}
			// As on a database written before events: no event for most.
			e.exec(t, `DELETE FROM idem_outbox WHERE id <> '`+kept[0].ID+`' AND id <> '`+kept[1].ID+`'`)
			e.exec(t, unmarkOrders)
			var steps []int
			added, err := bf.BackfillEvents(ctx, 4, func(total int) { steps = append(steps, total) })
			if err != nil || added != n-2 {
				t.Fatalf("BackfillEvents = %d, %v; want %d", added, err, n-2)
			}
			// A call per batch of 4 orders read: 25 orders, 7 batches.
			if len(steps) != 7 || steps[len(steps)-1] != n-2 || !slices.IsSorted(steps) {
				t.Errorf("progress = %v, want 7 calls, the totals so far, ending at %d", steps, n-2)
			}
			// Again without half of them, four callers at once.
			e.exec(t, `DELETE FROM idem_outbox WHERE id IN (SELECT id FROM idem_outbox ORDER BY seq DESC LIMIT 12)`)
			e.exec(t, unmarkOrders)
			var wg sync.WaitGroup
			var mu sync.Mutex
			total := 0
			for range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					added, err := bf.BackfillEvents(ctx, 3, nil)
					if err != nil {
						t.Errorf("BackfillEvents: %v", err)
					}
					mu.Lock()
					total += added
					mu.Unlock()
				}()
			}
			wg.Wait()
			if total != 12 {
				t.Errorf("four callers added %d events, want 12", total)
			}
			evs := allEvents(t, e.table)
			if len(evs) != n {
				t.Fatalf("%d events after the backfill, want %d", len(evs), n)
			}
			byID := map[string]outbox.Event{}
			for _, ev := range evs {
				byID[ev.ID] = ev
			}
			if err := e.repo.AllOrders(ctx, func(o Order) error {
				want, err := EventFor(&o)
				if err != nil {
					return err
				}
				got, ok := byID[want.ID]
				if !ok || !bytes.Equal(got.Body, want.Body) || got.Subject != want.Subject || got.OrderingKey != want.OrderingKey {
					t.Errorf("order %s's event = %+v, want %+v", o.ID, got, want)
				}
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			if evs[0].ID != kept[0].ID || evs[1].ID != kept[1].ID {
				t.Errorf("the events that were there are not first: %s %s", evs[0].ID, evs[1].ID)
			}
			if added, err := bf.BackfillEvents(ctx, 10, nil); err != nil || added != 0 {
				t.Errorf("BackfillEvents with nothing to do = %d, %v", added, err)
			}
		})
	}
}

// TestBackfillSkipsMarkedOrders: an order written with its event is marked,
// and BackfillEvents does not read it again: an event deleted from the
// outbox once sent (outbox.Sweeper) is never added, and published, a
// second time. The orders it did backfill are marked too.
func TestBackfillSkipsMarkedOrders(t *testing.T) {
	for name, open := range repoEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			bf := e.repo.(backfiller)
			at := time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)
			for i := range 6 {
				if err := e.repo.Create(ctx, backfillOrder(fmt.Sprintf("ord_%024x", i), "user-1", at.Add(time.Duration(i)*time.Second))); err != nil {
					t.Fatal(err)
				}
			}
			// Two of them as an older binary wrote them: unmarked, no event.
			e.exec(t, `UPDATE orders SET event_added = NULL WHERE id IN ('ord_000000000000000000000000', 'ord_000000000000000000000001')`)
			// Every event sent and swept.
			e.exec(t, `DELETE FROM idem_outbox`)
			var batches int
			added, err := bf.BackfillEvents(ctx, 1, func(int) { batches++ })
			// Batches of one: one per unmarked order, then the empty one
			// that ends the walk (reading the 4 marked ones would make 7).
			if err != nil || added != 2 || batches != 3 {
				t.Fatalf("BackfillEvents = %d, %v in %d batches; want the 2 unmarked orders' events, in 3 batches", added, err, batches)
			}
			if got := len(allEvents(t, e.table)); got != 2 {
				t.Errorf("%d events in the outbox, want 2", got)
			}
			e.exec(t, `DELETE FROM idem_outbox`)
			batches = 0
			if added, err := bf.BackfillEvents(ctx, 1, func(int) { batches++ }); err != nil || added != 0 || batches != 1 {
				t.Errorf("BackfillEvents once every order is marked = %d, %v in %d batches; want 0 in 1 (empty) batch", added, err, batches)
			}
		})
	}
}
