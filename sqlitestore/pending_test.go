package sqlitestore_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"testing/fstest"

	"github.com/idem-go/idem/sqlitestore"
)

// OpenExisting opens a database file that exists without migrating it,
// and creates none; Pending and PendingMigrations list what Open and
// ApplyMigrations would apply, creating no table.
func TestOpenExistingAndPending(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "keys.db")
	if _, err := sqlitestore.OpenExisting(ctx, path, sqlitestore.Options{}); !errors.Is(err, sqlitestore.ErrNoDatabase) {
		t.Fatalf("OpenExisting of no file: %v, want ErrNoDatabase", err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("OpenExisting created %s: %v", path, err)
	}
	if err := os.WriteFile(path, nil, 0o600); err != nil { // an empty file is an empty database
		t.Fatal(err)
	}
	st, err := sqlitestore.OpenExisting(ctx, path, sqlitestore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	own, err := sqlitestore.Pending(ctx, st.DB())
	files, _ := filepath.Glob(filepath.Join("migrations", "*.sql"))
	if err != nil || len(own) == 0 || len(own) != len(files) || !slices.IsSorted(own) {
		t.Fatalf("Pending of an empty database: %v, %v; want every migration of the store", own, err)
	}
	fsys := fstest.MapFS{
		"0001_a.sql": {Data: []byte(`CREATE TABLE pending_a (id INTEGER)`)},
		"0002_b.sql": {Data: []byte(`CREATE TABLE pending_b (id INTEGER)`)},
	}
	if got, err := sqlitestore.PendingMigrations(ctx, st.DB(), "app", fsys); err != nil || !slices.Equal(got, []string{"0001_a.sql", "0002_b.sql"}) {
		t.Fatalf("PendingMigrations of an empty database: %v, %v; want both", got, err)
	}
	var n int
	if err := st.DB().QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master WHERE type = 'table'`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d tables (%v) after Pending, want none", n, err)
	}
	if err := sqlitestore.ApplyMigrations(ctx, st.DB(), "app", fstest.MapFS{"0001_a.sql": fsys["0001_a.sql"]}); err != nil {
		t.Fatal(err)
	}
	if got, err := sqlitestore.PendingMigrations(ctx, st.DB(), "app", fsys); err != nil || !slices.Equal(got, []string{"0002_b.sql"}) {
		t.Errorf("after an older binary's migration: %v, %v; want 0002_b.sql", got, err)
	}
	if own2, err := sqlitestore.Pending(ctx, st.DB()); err != nil || !slices.Equal(own2, own) {
		t.Errorf("Pending after another component's migration: %v, %v; want %v", own2, err, own)
	}
	st.Close()

	migrated, err := sqlitestore.Open(ctx, path, sqlitestore.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer migrated.Close()
	if own, err := sqlitestore.Pending(ctx, migrated.DB()); err != nil || own != nil {
		t.Errorf("Pending after Open: %v, %v; want none", own, err)
	}
}
