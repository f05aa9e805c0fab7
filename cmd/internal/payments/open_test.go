package payments

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/internal/pgtest"
)

// TestPostgresPool: instances that start at once all get a pool and
// migrate the gateway's schema once, creating it; the tables land in it,
// although the pools send no search_path, not even the URL's. Without a
// schema the URL's search_path is kept. Every pool gets pgconfig's
// settings.
func TestPostgresPool(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	url, base := pgtest.Schema(t)  // the URL's search_path names it
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
	withPath := url + "?search_path=" + base
	if strings.Contains(url, "?") {
		withPath = url + "&search_path=" + base
	}

	const n = 6
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			pool, err := PostgresPool(ctx, withPath, schema)
			if err != nil {
				errs[i] = err
				return
			}
			defer pool.Close()
			_, _, errs[i] = OpenPostgres(ctx, pool, schema)
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("instance %d: %v", i, err)
		}
	}

	pool := testPool(t, withPath, schema)
	var sp, enc string
	if err := pool.QueryRow(ctx, `SELECT current_setting('search_path'), current_setting('client_encoding')`).Scan(&sp, &enc); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(sp, base) || strings.Contains(sp, schema) {
		t.Errorf("search_path of the gateway's pool = %q; want the server's default, without the URL's %q", sp, base)
	}
	if enc != "UTF8" {
		t.Errorf("client_encoding = %q, want UTF8 (pgconfig.Apply)", enc)
	}
	if m := pool.Config().ConnConfig.DefaultQueryExecMode; m != pgx.QueryExecModeCacheDescribe {
		t.Errorf("query mode = %v, want cache_describe (pgconfig.Apply)", m)
	}
	var tables, elsewhere int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE schemaname = $1), count(*) FILTER (WHERE schemaname = $2)
FROM pg_tables WHERE tablename IN ('payment_intents', 'refunds', 'idempotency_keys', 'schema_migrations')`, schema, base).Scan(&tables, &elsewhere); err != nil || tables != 4 || elsewhere != 0 {
		t.Errorf("tables in %s: %d, in the URL's %s: %d, %v; want 4 and 0", schema, tables, base, elsewhere, err)
	}
	var applied int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "schema_migrations"}.Sanitize()+` WHERE component = $1`, Component).Scan(&applied); err != nil || applied != 3 {
		t.Errorf("%s migrations recorded: %d, %v; want 3", Component, applied, err)
	}

	// Without a schema, the pool keeps the URL's search_path.
	def, err := PostgresPool(ctx, withPath, "")
	if err != nil {
		t.Fatal(err)
	}
	defer def.Close()
	if err := def.QueryRow(ctx, `SHOW search_path`).Scan(&sp); err != nil || sp != base {
		t.Errorf("search_path without a schema = %q, %v; want the URL's %q", sp, err, base)
	}

	if _, err := PostgresPool(ctx, "postgres://db:port/x", "payments"); err == nil {
		t.Error("PostgresPool of a bad URL = nil error")
	}
}
