package outbox_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/outbox"
)

// Pending lists the table's migrations before Migrate, creating nothing,
// and none after it.
func TestPending(t *testing.T) {
	ctx := context.Background()
	t.Run("SQLite", func(t *testing.T) {
		db := openSQLite(t, filepath.Join(t.TempDir(), "outbox.db"))
		tb := outbox.NewSQLite(db)
		if got, err := tb.Pending(ctx); err != nil || len(got) == 0 {
			t.Fatalf("before Migrate: %v, %v; want the table's migrations", got, err)
		}
		var n int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master WHERE name = 'outbox'`).Scan(&n); err != nil || n != 0 {
			t.Fatalf("Pending created the table (%d, %v)", n, err)
		}
		if err := tb.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		if got, err := tb.Pending(ctx); err != nil || got != nil {
			t.Errorf("after Migrate: %v, %v; want none", got, err)
		}
	})
	t.Run("PostgreSQL", func(t *testing.T) {
		pool := pgtest.Pool(t)
		tb := outbox.NewPostgres(pool)
		if got, err := tb.Pending(ctx); err != nil || len(got) == 0 {
			t.Fatalf("before Migrate: %v, %v; want the table's migrations", got, err)
		}
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = current_schema()`).Scan(&n); err != nil || n != 0 {
			t.Fatalf("Pending created %d tables (%v)", n, err)
		}
		if err := tb.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		if got, err := tb.Pending(ctx); err != nil || got != nil {
			t.Errorf("after Migrate: %v, %v; want none", got, err)
		}
	})
}
