package orders

// BackfillEvents under an adversarial read (issue 14): races with
// requests and with other backfills, odd order ids, two schemas.

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/outbox"
)

func backfillOrder(id, user string, at time.Time) *Order {
	return &Order{ID: id, UserID: user, Status: StatusPaid, Items: []Item{{SKU: "A", Quantity: 1, UnitPrice: 100}},
		Total: 100, Currency: "EUR", PaymentID: "pi_" + id, CreatedAt: at}
}

// checkBackfill: every order has exactly one event, EventFor of the order read back;
// no event without its order.
func checkBackfill(t *testing.T, e repoEnv) {
	t.Helper()
	evs := allEvents(t, e.table)
	byID := map[string]outbox.Event{}
	for _, ev := range evs {
		if _, dup := byID[ev.ID]; dup {
			t.Errorf("event %s twice", ev.ID)
		}
		byID[ev.ID] = ev
	}
	n := 0
	if err := e.repo.AllOrders(context.Background(), func(o Order) error {
		n++
		want, err := EventFor(&o)
		if err != nil {
			return err
		}
		got, ok := byID[want.ID]
		if !ok {
			t.Errorf("order %q has no event", o.ID)
		} else if !bytes.Equal(got.Body, want.Body) {
			t.Errorf("order %q event body %q, want %q", o.ID, got.Body, want.Body)
		}
		delete(byID, want.ID)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	for id := range byID {
		t.Errorf("event %q without its order", id)
	}
}

// The no-op UPDATE ... WHERE 0 does take SQLite's write lock in a deferred
// transaction.
func TestSQLiteNoopUpdateTakesWriteLock(t *testing.T) {
	_, db := openRepo(t)
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `UPDATE idem_outbox SET attempts = attempts WHERE 0`); err != nil {
		t.Fatal(err)
	}
	var file string
	if err := db.QueryRow(`SELECT file FROM pragma_database_list WHERE name='main'`).Scan(&file); err != nil {
		t.Fatal(err)
	}
	db2, err := sql.Open("sqlite", file+"?_pragma=busy_timeout(200)&_pragma=journal_mode(WAL)")
	if err != nil {
		t.Fatal(err)
	}
	defer db2.Close()
	_, err = db2.Exec(`INSERT INTO idem_outbox (id, seq, ordering_key, subject, body, created_at) VALUES ('x', 1, 'k', 's', x'00', 0)`)
	if err == nil {
		t.Fatal("a second connection wrote while the no-op UPDATE's transaction was open: no write lock")
	}
	t.Logf("second writer: %v (the lock is held)", err)
}

// A Create inside an open request transaction (order + event inserted, not
// committed) while BackfillEvents runs elsewhere.
func TestBackfillBesideOpenRequestTx(t *testing.T) {
	for name, open := range repoEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			bf := e.repo.(backfiller)
			// A legacy order without event.
			if err := e.repo.Create(ctx, backfillOrder("ord_000000000000000000000001", "u1", time.Date(2025, 1, 1, 0, 0, 0, 123456000, time.UTC))); err != nil {
				t.Fatal(err)
			}
			e.exec(t, `DELETE FROM idem_outbox`)
			e.exec(t, unmarkOrders)
			done := make(chan struct{})
			var bfN int
			var bfErr error
			e.inTx(t, true, func(repo Repository) {
				if err := repo.Create(ctx, backfillOrder("ord_000000000000000000000002", "u1", time.Date(2025, 1, 2, 0, 0, 0, 5000, time.UTC))); err != nil {
					t.Fatal(err)
				}
				go func() {
					defer close(done)
					bfN, bfErr = bf.BackfillEvents(ctx, 500, nil)
				}()
				time.Sleep(700 * time.Millisecond)
			})
			<-done
			if bfErr != nil {
				t.Fatalf("BackfillEvents during an open request tx: %v", bfErr)
			}
			t.Logf("backfill added %d", bfN)
			if n, err := bf.BackfillEvents(ctx, 500, nil); err != nil || n != 0 {
				t.Errorf("second pass = %d, %v", n, err)
			}
			checkBackfill(t, e)
		})
	}
}

// Backfills racing with many concurrent Creates.
func TestBackfillRacesCreates(t *testing.T) {
	for name, open := range repoEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			bf := e.repo.(backfiller)
			base := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
			for i := range 300 {
				if err := e.repo.Create(ctx, backfillOrder(fmt.Sprintf("ord_%024x", i), fmt.Sprintf("u%d", i%7), base.Add(time.Duration(i)*time.Millisecond+777*time.Microsecond))); err != nil {
					t.Fatal(err)
				}
			}
			e.exec(t, `DELETE FROM idem_outbox`)
			e.exec(t, unmarkOrders)
			var wg sync.WaitGroup
			for w := range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := range 40 {
						id := fmt.Sprintf("ord_%024x", 100000+w*1000+i)
						// created_at older than the legacy ones too, so the
						// backfill's ORDER BY sees them first.
						at := base.Add(-time.Duration(i) * time.Second).Add(time.Duration(w) * time.Microsecond)
						if err := e.repo.Create(ctx, backfillOrder(id, fmt.Sprintf("u%d", i%7), at)); err != nil {
							t.Errorf("Create %s during the backfill: %v", id, err)
						}
					}
				}()
			}
			for range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						n, err := bf.BackfillEvents(ctx, 7, nil)
						if err != nil {
							t.Errorf("BackfillEvents: %v", err)
							return
						}
						if n == 0 {
							return
						}
					}
				}()
			}
			wg.Wait()
			if n, err := bf.BackfillEvents(ctx, 500, nil); err != nil {
				t.Errorf("final pass: %v", err)
			} else {
				t.Logf("final pass added %d", n)
			}
			checkBackfill(t, e)
		})
	}
}

// Order ids that are not "ord_" + 24 hex: the SQL event id must be Go's
// EventID, or the backfill either re-adds an event (a duplicate under
// another id) or fails on every start (Go's id exists).
func TestBackfillOddOrderIDs(t *testing.T) {
	ids := []string{"", "o", "or", "ord", "ord_", "ORD_abc", "Ord_abc", "ord-abc", "ord_é", "ordé_x", "é", "ord_日本語",
		"évt", "ord_ abc", " ord_x", "ord__", "evt_abc", "evt-ord_abc", "ord_\u00a0", "ｏrd_x", "ord_\U0001F600x"}
	for name, open := range repoEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			bf := e.repo.(backfiller)
			at := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
			for i, id := range ids {
				if err := e.repo.Create(ctx, backfillOrder(id, "u", at.Add(time.Duration(i)*time.Second))); err != nil {
					t.Fatalf("Create %q: %v", id, err)
				}
			}
			if n, err := bf.BackfillEvents(ctx, 500, nil); err != nil || n != 0 {
				t.Errorf("BackfillEvents with every event there = %d, %v", n, err)
			}
			e.exec(t, `DELETE FROM idem_outbox WHERE seq % 2 = 0`)
			e.exec(t, unmarkOrders)
			if n, err := bf.BackfillEvents(ctx, 500, nil); err != nil || n != len(ids)/2 {
				t.Errorf("BackfillEvents after losing half = %d, %v; want %d", n, err, len(ids)/2)
			}
			checkBackfill(t, e)
		})
	}
}

// SQLite: an order id "ord_" followed by a NUL byte. Go's EventID keeps the
// bytes after the NUL; SQLite's substr() stops at the NUL, so the SQL event
// id differs from the one Create wrote: the anti-join never finds the event,
// and BackfillEvents then fails (outbox.ErrExists) on every call, so
// `orders serve` and `orders migrate` can no longer start.
func TestBackfillSQLiteNULOrderID(t *testing.T) {
	repo, db := openRepo(t)
	ctx := context.Background()
	id := "ord_\x00abc"
	if err := repo.Create(ctx, backfillOrder(id, "u", time.Now())); err != nil {
		t.Fatalf("Create: %v", err)
	}
	_ = db
	if n, err := repo.BackfillEvents(ctx, 500, nil); err != nil || n != 0 {
		t.Errorf("BackfillEvents with the order's event there = %d, %v; want 0, nil", n, err)
	}
}

// Two backfills at once on PostgreSQL, each in its own schema (search_path).
func TestBackfillPostgresTwoSchemas(t *testing.T) {
	open := repoEnvs()["PostgreSQL"]
	envs := []repoEnv{open(t), open(t)}
	ctx := context.Background()
	for k, e := range envs {
		for i := range 200 {
			if err := e.repo.Create(ctx, backfillOrder(fmt.Sprintf("ord_%024x", i), "u"+strconv.Itoa(i%5), time.Date(2025, 1, 1, 0, 0, i, 0, time.UTC))); err != nil {
				t.Fatal(k, err)
			}
		}
		e.exec(t, `DELETE FROM idem_outbox`)
		e.exec(t, unmarkOrders)
	}
	var wg sync.WaitGroup
	for _, e := range envs {
		for range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					n, err := e.repo.(backfiller).BackfillEvents(ctx, 9, nil)
					if err != nil {
						t.Errorf("BackfillEvents: %v", err)
						return
					}
					if n == 0 {
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	for _, e := range envs {
		checkBackfill(t, e)
	}
}

// TestBackfillSkipsOrderMarkedMeanwhile: two processes backfill one order
// an older binary left without its event. The second finds the event
// missing (without a lock); meanwhile the first adds it and marks the
// order, the relay sends it and a sweep deletes it. When the second takes
// the lock the outbox again shows no event: the order's mark, read under
// the lock, is what keeps it from adding the event, and the relay from
// publishing it, a second time.
func TestBackfillSkipsOrderMarkedMeanwhile(t *testing.T) {
	for name, open := range repoEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			o := backfillOrder("ord_00000000000000000000000a", "user-1", time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC))
			if err := e.repo.Create(ctx, o); err != nil {
				t.Fatal(err)
			}
			e.exec(t, `DELETE FROM idem_outbox`)
			e.exec(t, unmarkOrders)

			first := true
			meanwhile := func() {
				if !first {
					return
				}
				first = false
				if n, err := e.repo.(backfiller).BackfillEvents(ctx, 10, nil); err != nil || n != 1 {
					t.Fatalf("the other process's BackfillEvents = %d, %v; want 1", n, err)
				}
				if sent, err := e.table.Take(ctx, 10, func(context.Context, outbox.Event) error { return nil }); err != nil || sent != 1 {
					t.Fatalf("Take = %d, %v; want 1", sent, err)
				}
				// Past sent_at, by either clock (the database's on PostgreSQL).
				if swept, err := e.table.(outbox.Sweeper).DeleteSent(ctx, time.Now().Add(time.Minute), 10); err != nil || swept != 1 {
					t.Fatalf("DeleteSent = %d, %v; want 1", swept, err)
				}
			}
			var added int
			var err error
			switch r := e.repo.(type) {
			case *SQLiteRepository:
				without := func(ctx context.Context, ids []string) ([]string, error) {
					missing, err := sqliteWithoutEvent(ctx, r.db, ids)
					meanwhile()
					return missing, err
				}
				added, err = backfill(ctx, 10, nil, r.keys, without, r.addMissingEvents)
			case *PostgresRepository:
				without := func(ctx context.Context, ids []string) ([]string, error) {
					missing, err := pgWithoutEvent(ctx, r.pool, ids)
					meanwhile()
					return missing, err
				}
				added, err = backfill(ctx, 10, nil, r.keys, without, r.addMissingEvents)
			default:
				t.Fatalf("repository %T", e.repo)
			}
			if err != nil {
				t.Fatal(err)
			}
			if events := allEvents(t, e.table); added != 0 || len(events) != 0 {
				t.Errorf("the second backfill added %d events (the outbox holds %d) for order %s, which the first one backfilled and a sweep emptied; want 0", added, len(events), o.ID)
			}
		})
	}
}
