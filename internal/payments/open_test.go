package payments

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/internal/pgtest"
)

// TestPostgresPool: instances that start at once all get a pool on the
// schema, created once, and migrate it once; the tables land in it.
func TestPostgresPool(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	url, base := pgtest.SchemaName(t)
	schema := base + "_Mixed-Case" // needs quoting
	t.Cleanup(func() {
		conn, err := pgx.Connect(context.Background(), url)
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close(context.Background())
		if _, err := conn.Exec(context.Background(), "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			t.Error(err)
		}
	})

	const n = 6
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			pool, err := PostgresPool(ctx, url, schema)
			if err != nil {
				errs[i] = err
				return
			}
			defer pool.Close()
			_, _, errs[i] = OpenPostgres(ctx, pool)
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("instance %d: %v", i, err)
		}
	}

	pool := testPool(t, url, schema)
	var current string
	if err := pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&current); err != nil || current != schema {
		t.Errorf("current_schema() = %q, %v; want %q", current, err, schema)
	}
	var tables int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename IN ('payment_intents', 'refunds', 'idempotency_keys', 'schema_migrations')`, schema).Scan(&tables); err != nil || tables != 4 {
		t.Errorf("tables in %s: %d, %v; want 4", schema, tables, err)
	}
	var applied int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM schema_migrations WHERE component = $1`, Component).Scan(&applied); err != nil || applied != 3 {
		t.Errorf("%s migrations recorded: %d, %v; want 3", Component, applied, err)
	}

	// Without a schema, the pool keeps the URL's search_path.
	def, err := PostgresPool(ctx, url, "")
	if err != nil {
		t.Fatal(err)
	}
	defer def.Close()
	var sp string
	if err := def.QueryRow(ctx, `SHOW search_path`).Scan(&sp); err != nil || sp == schema {
		t.Errorf("search_path without a schema = %q, %v", sp, err)
	}

	if _, err := PostgresPool(ctx, "postgres://db:port/x", "payments"); err == nil {
		t.Error("PostgresPool of a bad URL = nil error")
	}
}
