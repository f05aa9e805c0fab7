package ordersapp

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/internal/pgtest"
)

// On PostgreSQL the orders' primary key is (id, user_id) since migration
// 0008: an order of a second user under a taken id is refused by nothing
// in orders itself, and the audit must report it wherever it falls in the
// audit's pages of orders (2,000 a page): here the two orders of the id
// end the first page and begin the second.
func TestAuditReportsTwoUsersOrdersUnderOneID(t *testing.T) {
	skipInShort(t, "seeds orders and runs the audit")
	const n = 2000 // one page of orders.OrdersByID
	db := pgtest.Database(t)
	ctx := context.Background()
	c := Config{DataDir: t.TempDir(), DatabaseURL: db, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: seedKeyLease,
		PaymentsKey: seedPaymentsKey, RequireKey: true}
	srv, err := (&App{}).newServer(ctx, &c, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close()
	if err := seedAudit(ctx, t, srv.backend, srv.broker.js, 0, n); err != nil {
		t.Fatal(err)
	}
	// The order of the last id, again, for another user, without a key.
	pgExec(t, db, `INSERT INTO orders (id, user_id, status, items, total, currency, payment_id, created_at, event_added)
		SELECT id, 'mallory', status, items, total, currency, payment_id, created_at, event_added
		FROM orders ORDER BY id DESC LIMIT 1`)
	var shared string
	if err := srv.backend.ordersByID(ctx, time.Time{}, func(o orders.Order) error { shared = o.ID; return nil }); err != nil {
		t.Fatal(err)
	}

	rep, err := runAudit(ctx, srv.backend, srv.payer, srv.broker.js, nil)
	if err != nil {
		t.Fatalf("audit: %v", err)
	}
	if want := fmt.Sprintf("order %s appears twice", shared); !slices.Contains(rep.Violations, want) {
		t.Errorf("audit violations %q; want %q among them", rep.Violations, want)
	}
}
