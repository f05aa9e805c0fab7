package orders

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// Since migration 0008, PostgreSQL's orders are keyed on (id, user_id):
// nothing in orders itself refuses a second user's order under an id that
// is taken, and the audit is what reports one ("order … appears twice").
// OrdersByID, which the audit reads the orders with, must return both,
// even when they fall on either side of a page's end.
func TestOrdersByIDReadsOrdersSharingAnID(t *testing.T) {
	ctx := context.Background()
	repo, pool := pgOpenRepo(t)
	// scanPageSize orders, the last of the first page (by id) sharing its
	// id with an order of another user: together they end the first page
	// and begin the second.
	if _, err := pool.Exec(ctx, `INSERT INTO orders (id, user_id, status, items, total, currency, payment_id, created_at, event_added)
		SELECT 'ord_' || lpad(g::text, 24, '0'), 'user-' || g, 'paid', '[]', 5, 'EUR', 'pi_' || g, now(), true
		FROM generate_series(1, $1::int) g`, scanPageSize); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO orders (id, user_id, status, items, total, currency, payment_id, created_at, event_added)
		SELECT id, 'mallory', status, items, total, currency, 'pi_shared', created_at, event_added
		FROM orders ORDER BY id DESC LIMIT 1`); err != nil {
		t.Fatal(err)
	}
	var (
		n     int
		users = map[string][]string{}
	)
	err := repo.OrdersByID(ctx, time.Time{}, func(o Order) error {
		n++
		users[o.ID] = append(users[o.ID], o.UserID)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	shared := fmt.Sprintf("ord_%024d", scanPageSize)
	if n != scanPageSize+1 || len(users[shared]) != 2 {
		t.Errorf("OrdersByID read %d orders, order %s of users %v; want %d, and %s of two users",
			n, shared, users[shared], scanPageSize+1, shared)
	}
}

// So are receipts, on (id, user_id): ReceiptsSince, which the audit reads
// the receipts with, returns two receipts of one order under one id but of
// two users, even when a page ends between them.
func TestReceiptsSinceReadsReceiptsSharingAnID(t *testing.T) {
	ctx := context.Background()
	repo, pool := pgOpenRepo(t)
	if _, err := pool.Exec(ctx, `INSERT INTO receipts (id, order_id, event_id, user_id, total, currency, created_at)
		SELECT 'rcp_' || lpad(g::text, 24, '0'), 'ord_a', 'evt_a' || g, 'alice', 5, 'EUR', now()
		FROM generate_series(1, $1::int) g`, scanPageSize); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO receipts (id, order_id, event_id, user_id, total, currency, created_at)
		SELECT id, order_id, event_id, 'mallory', total, currency, created_at
		FROM receipts ORDER BY id DESC LIMIT 1`); err != nil {
		t.Fatal(err)
	}
	var (
		n     int
		users = map[string][]string{}
	)
	err := repo.ReceiptsSince(ctx, time.Time{}, func(r Receipt) error {
		n++
		users[r.ID] = append(users[r.ID], r.UserID)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	shared := fmt.Sprintf("rcp_%024d", scanPageSize)
	if n != scanPageSize+1 || len(users[shared]) != 2 {
		t.Errorf("ReceiptsSince read %d receipts, receipt %s of users %v; want %d, and %s of two users",
			n, shared, users[shared], scanPageSize+1, shared)
	}
}
