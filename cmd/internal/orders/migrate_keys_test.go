package orders

import (
	"context"
	"errors"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/outbox/pgoutbox"
	"github.com/idem-go/idem/pgstore"
)

// A database written before every key included the user is upgraded with
// its rows, whether the migration builds the new indexes or an operator
// built them beforehand (CREATE UNIQUE INDEX CONCURRENTLY under their
// names); afterwards the keys include user_id and still refuse what they
// refused: the same order again, a second receipt of one event.
func TestMigrateKeysIncludeUser(t *testing.T) {
	prebuilt := []string{
		`CREATE UNIQUE INDEX CONCURRENTLY orders_id_user_id ON orders (id, user_id)`,
		`CREATE UNIQUE INDEX CONCURRENTLY receipts_id_user_id ON receipts (id, user_id)`,
		`CREATE UNIQUE INDEX CONCURRENTLY receipts_event_id_user_id ON receipts (event_id, user_id)`,
		`CREATE UNIQUE INDEX CONCURRENTLY receipt_duplicates_id_user_id ON receipt_duplicates (id, user_id)`,
	}
	for _, tc := range []struct {
		name   string
		before []string
	}{
		{"indexes built by the migration", nil},
		{"indexes built beforehand", prebuilt},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			pool := pgPool(t)
			if err := pgoutbox.New(pool).Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			if err := pgstore.ApplyMigrations(ctx, pool, "orders", migrationsUpTo(t, PostgresMigrations, 7)); err != nil {
				t.Fatal(err)
			}
			noTx := func(context.Context) (pgx.Tx, error) { return nil, idem.ErrNoTx }
			repo := NewPostgresRepository(pool, noTx)
			at := time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)
			newOrder := func(id, user, sku string) *Order {
				return &Order{
					ID: id, UserID: user, Status: StatusPaid, Items: []Item{{SKU: sku, Quantity: 1, UnitPrice: 5}},
					Total: 5, Currency: "EUR", PaymentID: "pi_" + id, CreatedAt: at, IdempotencyKey: "k-" + id, KeyCreatedAt: at,
				}
			}
			for _, o := range []*Order{newOrder("ord_a", "alice", "A"), newOrder("ord_b", "bob", "B")} {
				if err := repo.Create(ctx, o); err != nil {
					t.Fatal(err)
				}
			}
			first := Receipt{ID: "rcp_a", OrderID: "ord_a", EventID: EventID("ord_a"), UserID: "alice", Total: 5, Currency: "EUR", CreatedAt: at}
			// As the previous version wrote them (its insert names the
			// old key, which this version's does not).
			if _, err := pool.Exec(ctx, `INSERT INTO receipts (id, order_id, event_id, user_id, total, currency, created_at)
				VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (event_id) DO NOTHING`,
				first.ID, first.OrderID, first.EventID, first.UserID, first.Total, first.Currency, first.CreatedAt); err != nil {
				t.Fatal(err)
			}
			if _, err := pool.Exec(ctx, `INSERT INTO receipt_duplicates (id, order_id, event_id, user_id, total, currency, created_at, removed_at)
				VALUES ('rcp_d', 'ord_a', $1, 'alice', 5, 'EUR', $2, $2)`, EventID("ord_a"), at); err != nil {
				t.Fatal(err)
			}
			for _, s := range tc.before {
				if _, err := pool.Exec(ctx, s); err != nil {
					t.Fatalf("%s: %v", s, err)
				}
			}

			if err := MigratePostgres(ctx, pool); err != nil {
				t.Fatalf("upgrading: %v", err)
			}

			wantKeys := map[string][]string{
				"orders_pkey":                    {"id", "user_id"},
				"orders_user_id_idempotency_key": {"user_id", "idempotency_key", "idempotency_key_created_at"},
				"receipts_pkey":                  {"id", "user_id"},
				"receipts_event_id_user_id":      {"event_id", "user_id"},
				"receipt_duplicates_pkey":        {"id", "user_id"},
			}
			if got := uniqueKeys(t, pool, "orders", "receipts", "receipt_duplicates"); !maps.EqualFunc(got, wantKeys, slices.Equal[[]string]) {
				t.Errorf("keys after the upgrade = %v, want %v", got, wantKeys)
			}
			for _, u := range []struct{ user, id string }{{"alice", "ord_a"}, {"bob", "ord_b"}} {
				if _, err := repo.Get(ctx, u.user, u.id); err != nil {
					t.Errorf("order %s after the upgrade: %v", u.id, err)
				}
			}
			if err := repo.Create(ctx, newOrder("ord_a", "alice", "A")); !errors.Is(err, ErrExists) {
				t.Errorf("Create of an order kept through the upgrade = %v, want ErrExists", err)
			}
			if got, added, err := repo.AddReceipt(ctx, Receipt{OrderID: "ord_a", EventID: EventID("ord_a"), UserID: "alice", Total: 5, Currency: "EUR"}); err != nil || added || got.ID != first.ID {
				t.Errorf("a second receipt of one event after the upgrade: AddReceipt = %+v, %v, %v; want %s found, not added", got, added, err, first.ID)
			}
			var dups int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM receipt_duplicates`).Scan(&dups); err != nil || dups != 1 {
				t.Errorf("receipt_duplicates after the upgrade: %d rows, %v; want 1", dups, err)
			}
		})
	}
}

// uniqueKeys returns the unique indexes of tables, in the pool's schema,
// by name, each with its columns in order.
func uniqueKeys(t *testing.T, pool *pgxpool.Pool, tables ...string) map[string][]string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `
		SELECT i.relname::text, array_agg(a.attname::text ORDER BY k.ord)
		FROM pg_index x
		JOIN pg_class c ON c.oid = x.indrelid
		JOIN pg_class i ON i.oid = x.indexrelid
		CROSS JOIN LATERAL unnest(x.indkey) WITH ORDINALITY AS k(attnum, ord)
		JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum
		WHERE x.indisunique AND c.relnamespace = current_schema()::regnamespace AND c.relname = ANY($1)
		GROUP BY i.relname`, tables)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string][]string{}
	for rows.Next() {
		var name string
		var cols []string
		if err := rows.Scan(&name, &cols); err != nil {
			t.Fatal(err)
		}
		out[name] = cols
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}
