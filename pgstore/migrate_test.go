package pgstore_test

import (
	"context"
	"net/url"
	"strings"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	for range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := pgstore.Migrate(ctx, pool); err != nil {
				t.Errorf("Migrate: %v", err)
			}
		}()
	}
	wg.Wait()
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM schema_migrations WHERE component = $1`, pgstore.Component).Scan(&n); err != nil {
		t.Fatalf("reading schema_migrations: %v", err)
	}
	if n != 6 {
		t.Errorf("recorded migrations = %d, want 6 (0001 to 0006)", n)
	}
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Errorf("Migrate again: %v", err)
	}
	if _, err := pool.Exec(ctx, `SELECT user_id, key, expires_at FROM idempotency_keys`); err != nil {
		t.Errorf("idempotency_keys: %v", err)
	}
}

func TestApplyMigrations(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := context.Background()
	v1 := fstest.MapFS{
		"0001_things.sql": {Data: []byte(`CREATE TABLE things (id int); INSERT INTO things VALUES (1);`)},
	}
	if err := pgstore.ApplyMigrations(ctx, pool, "things", v1); err != nil {
		t.Fatalf("v1: %v", err)
	}
	v2 := fstest.MapFS{
		"0001_things.sql": v1["0001_things.sql"],
		"0010_more.sql":   {Data: []byte(`INSERT INTO things VALUES (10);`)},
		"0002_more.sql":   {Data: []byte(`INSERT INTO things VALUES (2);`)},
	}
	for range 2 {
		if err := pgstore.ApplyMigrations(ctx, pool, "things", v2); err != nil {
			t.Fatalf("v2: %v", err)
		}
	}
	var got []int
	rows, _ := pool.Query(ctx, `SELECT id FROM things ORDER BY id`)
	for rows.Next() {
		var id int
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		got = append(got, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || got[0] != 1 || got[1] != 2 || got[2] != 10 {
		t.Errorf("things = %v, want [1 2 10]: each migration once", got)
	}
	// Components are independent: the store's migrations go beside these.
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate: %v", err)
	}

	// A failing migration leaves nothing behind.
	bad := fstest.MapFS{
		"0001_ok.sql":  {Data: []byte(`CREATE TABLE ok_table (id int);`)},
		"0002_bad.sql": {Data: []byte(`SELECT no_such_column FROM ok_table;`)},
	}
	if err := pgstore.ApplyMigrations(ctx, pool, "bad", bad); err == nil {
		t.Fatal("a failing migration: got no error")
	}
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass('ok_table') IS NOT NULL`).Scan(&exists); err != nil || exists {
		t.Errorf("after a failed migration: ok_table exists = %v (%v), want false", exists, err)
	}

	for name, fsys := range map[string]fstest.MapFS{
		"bad name":  {"things.sql": {Data: []byte(`SELECT 1`)}},
		"duplicate": {"1_a.sql": {Data: []byte(`SELECT 1`)}, "0001_b.sql": {Data: []byte(`SELECT 1`)}},
		"empty":     {},
	} {
		if err := pgstore.ApplyMigrations(ctx, pool, "x", fsys); err == nil {
			t.Errorf("%s: got no error", name)
		}
	}
}

// MigrateSchema creates its schema when it is missing, and concurrently
// from several callers; a role that owns an existing schema but may not
// create schemas in the database migrates it all the same (CREATE SCHEMA
// IF NOT EXISTS would need that privilege even when the schema exists).
func TestMigrateSchema(t *testing.T) {
	t.Parallel()
	db := pgtest.Database(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := pgstore.MigrateSchema(ctx, pool, "created here"); err != nil {
				t.Errorf("MigrateSchema: %v", err)
			}
		}()
	}
	wg.Wait()
	if _, err := pool.Exec(ctx, `SELECT 1 FROM "created here".idempotency_keys`); err != nil {
		t.Fatalf("the table in the new schema: %v", err)
	}

	role := "r_" + strings.ReplaceAll(t.Name(), "/", "_")
	role = strings.ToLower(role)
	for _, q := range []string{
		`DROP ROLE IF EXISTS ` + role,
		`CREATE ROLE ` + role + ` LOGIN`,
		`REVOKE CREATE ON DATABASE ` + strings.TrimPrefix(mustParse(t, db).Path, "/") + ` FROM PUBLIC`,
		`CREATE SCHEMA owned AUTHORIZATION ` + role,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		pool, err := pgxpool.New(ctx, db)
		if err == nil {
			for _, q := range []string{`DROP SCHEMA owned CASCADE`, `DROP ROLE IF EXISTS ` + role} {
				if _, err := pool.Exec(ctx, q); err != nil {
					t.Errorf("%s: %v", q, err)
				}
			}
			pool.Close()
		}
	})
	u := mustParse(t, db)
	u.User = url.User(role)
	rp, err := pgxpool.New(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer rp.Close()
	if err := pgstore.MigrateSchema(ctx, rp, "owned"); err != nil {
		t.Errorf("MigrateSchema by the schema's owner without CREATE on the database: %v", err)
	}
}

func mustParse(t *testing.T, raw string) *url.URL {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return u
}
