package orders

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"
)

// PendingSQLite and PendingPostgres report the outbox's and the orders'
// migrations on an empty database, creating nothing, and nothing once
// migrated.
func TestPendingMigrations(t *testing.T) {
	ctx := context.Background()
	t.Run("SQLite", func(t *testing.T) {
		db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "orders.db"))
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		p, err := PendingSQLite(ctx, db)
		if err != nil || len(p["orders"]) == 0 || len(p["outbox"]) == 0 || p.Empty() {
			t.Fatalf("empty database: %v, %v; want the orders' and the outbox's migrations", p, err)
		}
		var n int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master WHERE type = 'table'`).Scan(&n); err != nil || n != 0 {
			t.Fatalf("%d tables (%v) after PendingSQLite, want none", n, err)
		}
		if err := MigrateSQLite(ctx, db); err != nil {
			t.Fatal(err)
		}
		if p, err := PendingSQLite(ctx, db); err != nil || !p.Empty() || len(p) != 0 {
			t.Errorf("migrated: %v, %v; want nothing", p, err)
		}
	})
	t.Run("PostgreSQL", func(t *testing.T) {
		pool := pgPool(t)
		p, err := PendingPostgres(ctx, pool)
		if err != nil || len(p["orders"]) == 0 || len(p["outbox"]) == 0 {
			t.Fatalf("empty schema: %v, %v; want the orders' and the outbox's migrations", p, err)
		}
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = current_schema()`).Scan(&n); err != nil || n != 0 {
			t.Fatalf("%d tables (%v) after PendingPostgres, want none", n, err)
		}
		if err := MigratePostgres(ctx, pool); err != nil {
			t.Fatal(err)
		}
		if p, err := PendingPostgres(ctx, pool); err != nil || !p.Empty() {
			t.Errorf("migrated: %v, %v; want nothing", p, err)
		}
	})
}
