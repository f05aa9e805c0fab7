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
