package orders

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
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
			pool := pgPoolBeforeKeysIncludeUser(t)
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

// An index built beforehand under one of the names that migration 0008
// reuses, but that is not the key it would build, stops the upgrade
// before anything changes: adopted, it would leave a key that enforces
// nothing (an invalid index, as a cancelled CREATE INDEX CONCURRENTLY
// leaves behind: receipts would have no unique index on the event, and
// the consumer's ON CONFLICT (event_id, user_id) would refuse every
// receipt) or one that lookups by id cannot use.
func TestMigrateKeysIncludeUserRefusesUnusableIndexes(t *testing.T) {
	ctx := context.Background()
	exec := func(q string) func(t *testing.T, pool *pgxpool.Pool) {
		return func(t *testing.T, pool *pgxpool.Pool) {
			t.Helper()
			if _, err := pool.Exec(ctx, q); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
	}
	// cancelled runs q, a CREATE INDEX CONCURRENTLY, until its statement
	// timeout cancels it while it waits for a transaction that writes
	// the table: the index stays, invalid.
	cancelled := func(table, index, q string) func(t *testing.T, pool *pgxpool.Pool) {
		return func(t *testing.T, pool *pgxpool.Pool) {
			t.Helper()
			writer, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer writer.Rollback(ctx)
			if _, err := writer.Exec(ctx, `LOCK TABLE `+table+` IN ROW EXCLUSIVE MODE`); err != nil {
				t.Fatal(err)
			}
			conn, err := pool.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Release()
			if _, err := conn.Exec(ctx, `SET statement_timeout = '300ms'`); err != nil {
				t.Fatal(err)
			}
			if _, err := conn.Exec(ctx, q); err == nil {
				t.Fatalf("%s: not cancelled", q)
			}
			if _, err := conn.Exec(ctx, `RESET statement_timeout`); err != nil {
				t.Fatal(err)
			}
			var valid bool
			if err := conn.QueryRow(ctx, `SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)`, index).Scan(&valid); err != nil || valid {
				t.Fatalf("index %s after the cancelled build: valid %v, %v; want an invalid index", index, valid, err)
			}
		}
	}
	for _, tc := range []struct {
		name, index string
		build       func(t *testing.T, pool *pgxpool.Pool)
	}{
		{"an invalid index left by a cancelled concurrent build", "receipts_event_id_user_id",
			cancelled("receipts", "receipts_event_id_user_id", `CREATE UNIQUE INDEX CONCURRENTLY receipts_event_id_user_id ON receipts (event_id, user_id)`)},
		{"an index that is not unique", "receipts_event_id_user_id",
			exec(`CREATE INDEX CONCURRENTLY receipts_event_id_user_id ON receipts (event_id, user_id)`)},
		{"a partial index", "receipts_event_id_user_id",
			exec(`CREATE UNIQUE INDEX CONCURRENTLY receipts_event_id_user_id ON receipts (event_id, user_id) WHERE total > 0`)},
		{"an index whose columns come in another order", "orders_id_user_id",
			exec(`CREATE UNIQUE INDEX CONCURRENTLY orders_id_user_id ON orders (user_id, id)`)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pool := pgPoolBeforeKeysIncludeUser(t)
			tc.build(t, pool)

			err := MigratePostgres(ctx, pool)
			if err == nil || !strings.Contains(err.Error(), tc.index) {
				t.Errorf("upgrading with %s named %s = %v, want an error naming it", tc.name, tc.index, err)
			}
			// Nothing applied: the key on the event alone is still there.
			var old bool
			if err := pool.QueryRow(ctx, `SELECT to_regclass('receipts_event_id') IS NOT NULL`).Scan(&old); err != nil || !old {
				t.Errorf("receipts_event_id after the refused upgrade: exists %v, %v; want it kept", old, err)
			}
		})
	}
}

// While migration 0008 builds its indexes, which takes as long as the
// tables are large, orders can still be read (GET /v1/orders, the
// consumer's look at an event's order): the builds lock their tables
// against writes only, and the keys are swapped, under locks that keep
// readers out, once every index is built.
func TestMigrateKeysIncludeUserKeepsOrdersReadableWhileBuilding(t *testing.T) {
	ctx := context.Background()
	pool := pgPoolBeforeKeysIncludeUser(t)
	// A transaction writing receipt_duplicates holds up the build of the
	// migration's last index: the upgrade waits there, as it would for
	// a long build.
	writer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Rollback(ctx)
	if _, err := writer.Exec(ctx, `LOCK TABLE receipt_duplicates IN ROW EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- MigratePostgres(ctx, pool) }()
	deadline := time.Now().Add(3 * time.Second)
	for {
		var waiting bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE relation = to_regclass('receipt_duplicates') AND NOT granted)`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the upgrade never waited for receipt_duplicates")
		}
		time.Sleep(10 * time.Millisecond)
	}
	reader, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := reader.Exec(ctx, `SET LOCAL lock_timeout = '500ms'`); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := reader.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil {
		t.Errorf("reading orders while the upgrade builds its indexes: %v", err)
	}
	reader.Rollback(ctx)
	if err := writer.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("upgrading: %v", err)
	}
}

// pgPoolBeforeKeysIncludeUser returns a pool on a fresh schema migrated as
// the version before migration 0008 left it: the outbox, then the orders'
// migrations up to 0007.
func pgPoolBeforeKeysIncludeUser(t *testing.T) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	pool := pgPool(t)
	if err := pgoutbox.New(pool).Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := pgstore.ApplyMigrations(ctx, pool, "orders", migrationsUpTo(t, PostgresMigrations, 7)); err != nil {
		t.Fatal(err)
	}
	return pool
}
