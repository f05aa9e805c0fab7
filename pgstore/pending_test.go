package pgstore_test

import (
	"context"
	"slices"
	"testing"
	"testing/fstest"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
)

// PendingMigrations lists what ApplyMigrations would apply, without
// creating schema_migrations, a table or a schema; nothing once applied,
// and the missing version of a schema migrated by an older binary.
func TestPendingMigrations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	fsys := fstest.MapFS{
		"0001_a.sql": {Data: []byte(`CREATE TABLE pending_a (id int)`)},
		"0002_b.sql": {Data: []byte(`CREATE TABLE pending_b (id int)`)},
	}
	tables := func() int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = current_schema()`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	got, err := pgstore.PendingMigrations(ctx, pool, "app", fsys)
	if err != nil || !slices.Equal(got, []string{"0001_a.sql", "0002_b.sql"}) {
		t.Fatalf("on an empty schema: %v, %v; want both", got, err)
	}
	if own, err := pgstore.Pending(ctx, pool); err != nil || len(own) != 6 {
		t.Errorf("Pending on an empty schema: %v, %v; want the store's 6", own, err)
	}
	if n := tables(); n != 0 {
		t.Fatalf("%d tables after PendingMigrations, want none", n)
	}

	older := fstest.MapFS{"0001_a.sql": fsys["0001_a.sql"]}
	if err := pgstore.ApplyMigrations(ctx, pool, "app", older); err != nil {
		t.Fatal(err)
	}
	if got, err := pgstore.PendingMigrations(ctx, pool, "app", fsys); err != nil || !slices.Equal(got, []string{"0002_b.sql"}) {
		t.Errorf("after an older binary's migration: %v, %v; want 0002_b.sql", got, err)
	}
	if got, err := pgstore.PendingMigrations(ctx, pool, "app", older); err != nil || got != nil {
		t.Errorf("the older binary's own migrations: %v, %v; want none", got, err)
	}
	if err := pgstore.ApplyMigrations(ctx, pool, "app", fsys); err != nil {
		t.Fatal(err)
	}
	if got, err := pgstore.PendingMigrations(ctx, pool, "app", fsys); err != nil || got != nil {
		t.Errorf("after ApplyMigrations: %v, %v; want none", got, err)
	}
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if own, err := pgstore.Pending(ctx, pool); err != nil || own != nil {
		t.Errorf("Pending after Migrate: %v, %v; want none", own, err)
	}
}

// PendingSchema looks in the schema named, whatever the search_path, and
// does not create it.
func TestPendingSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	_, schema := pgtest.SchemaName(t)
	if own, err := pgstore.PendingSchema(ctx, pool, schema); err != nil || len(own) != 6 {
		t.Fatalf("PendingSchema of a schema that does not exist: %v, %v; want the store's 6", own, err)
	}
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&exists); err != nil || exists {
		t.Fatalf("schema %s exists after PendingSchema (%v)", schema, err)
	}
	if err := pgstore.MigrateSchema(ctx, pool, schema); err != nil {
		t.Fatal(err)
	}
	if own, err := pgstore.PendingSchema(ctx, pool, schema); err != nil || own != nil {
		t.Errorf("PendingSchema after MigrateSchema: %v, %v; want none", own, err)
	}
	if own, err := pgstore.Pending(ctx, pool); err != nil || len(own) != 6 {
		t.Errorf("Pending of the search_path's schema, which has nothing: %v, %v; want the store's 6", own, err)
	}
}
