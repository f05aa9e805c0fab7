package pgstore_test

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/storetest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// execModes are pgx's five query execution modes, by the names a URL's
// default_query_exec_mode takes. A pool may be configured with any of
// them (a pooler's users pick exec or simple_protocol), and the store must
// work under each: a statement that works in one mode only (a jsonb
// argument sent as []byte, which exec and simple_protocol send as bytea)
// must not come back.
var execModes = []struct {
	name string
	mode pgx.QueryExecMode
}{
	{"cache_statement", pgx.QueryExecModeCacheStatement},
	{"cache_describe", pgx.QueryExecModeCacheDescribe},
	{"describe_exec", pgx.QueryExecModeDescribeExec},
	{"exec", pgx.QueryExecModeExec},
	{"simple_protocol", pgx.QueryExecModeSimpleProtocol},
}

// selectedExecModes are the modes TestConformance runs under: all five,
// unless TEST_PGX_MODES names some of them (comma-separated), for a faster
// run while working on something else. CI runs all five.
func selectedExecModes(t *testing.T) []struct {
	name string
	mode pgx.QueryExecMode
} {
	want := os.Getenv("TEST_PGX_MODES")
	if want == "" || os.Getenv("CI") == "true" {
		return execModes
	}
	var out []struct {
		name string
		mode pgx.QueryExecMode
	}
	for _, m := range execModes {
		for _, w := range strings.Split(want, ",") {
			if strings.TrimSpace(w) == m.name {
				out = append(out, m)
			}
		}
	}
	if len(out) == 0 {
		t.Fatalf("TEST_PGX_MODES=%q names none of pgx's modes", want)
	}
	return out
}

// TestConformance runs the suite every idem.Store passes, each store on a
// schema of its own: once for each of pgx's query modes set as the pool's
// default, the schema selected by the pool's search_path; once with the
// schema named by Options.Schema instead; and once behind PgBouncer in
// transaction pooling mode, on a pool with pgx's default settings; on a
// database whose encoding is not UTF8; and on a schema without the claim
// function.
func TestConformance(t *testing.T) {
	for _, m := range selectedExecModes(t) {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			runConformance(t, 0, func(t *testing.T) (*pgxpool.Pool, string) {
				return migratedPool(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = m.mode }), ""
			})
		})
	}
	t.Run("schema", func(t *testing.T) {
		t.Parallel()
		url := pgtest.URL(t)
		runConformance(t, 0, func(t *testing.T) (*pgxpool.Pool, string) {
			return schemaPool(t, url)
		})
	})
	t.Run("sql_ascii", func(t *testing.T) {
		t.Parallel()
		// A database whose encoding is SQL_ASCII, on pools that do not
		// set client_encoding: the session's is SQL_ASCII, under which
		// pgx refuses to write arguments into a simple-protocol query.
		url := pgtest.DatabaseWith(t, pgtest.SQLASCII)
		for _, m := range selectedExecModes(t) {
			t.Run(m.name, func(t *testing.T) {
				t.Parallel()
				// The harness's own statements (the handler's) are the
				// application's: pgx refuses them in the simple protocol
				// on this session, so they go in exec mode there.
				var handlerMode pgx.QueryExecMode
				if m.mode == pgx.QueryExecModeSimpleProtocol {
					handlerMode = pgx.QueryExecModeExec
				}
				runConformance(t, handlerMode, func(t *testing.T) (*pgxpool.Pool, string) {
					pool := pgtest.PoolOn(t, url, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = m.mode })
					migrate(t, pool)
					return pool, ""
				})
			})
		}
	})
	t.Run("without_claim_function", func(t *testing.T) {
		t.Parallel()
		// A schema migrated before idem_claim (0006), as during a rolling
		// deploy whose new instances start before the migration: claims
		// send the insert-or-read statement instead.
		runConformance(t, 0, func(t *testing.T) (*pgxpool.Pool, string) {
			pool := migratedPool(t)
			if _, err := pool.Exec(context.Background(), `DROP FUNCTION idem_claim`); err != nil {
				t.Fatal(err)
			}
			return pool, ""
		})
	})
	t.Run("pgbouncer", func(t *testing.T) {
		t.Parallel()
		url := pgtest.NewBouncer(t).URL("")
		// The handler's own statements are the application's: behind
		// PgBouncer they need a mode without named statements (a batch
		// takes the pool's), which the store's statements choose by
		// themselves.
		runConformance(t, pgx.QueryExecModeCacheDescribe, func(t *testing.T) (*pgxpool.Pool, string) {
			return schemaPool(t, url)
		})
	})
}

// schemaPool returns a pool on the database at url with pgx's default
// settings and a fresh schema that the pool's search_path does not
// select, with the store's table (MigrateSchema) and effects in it.
func schemaPool(t *testing.T, url string) (*pgxpool.Pool, string) {
	t.Helper()
	_, schema := pgtest.SchemaName(t)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = pgtest.DefaultMaxConns
	ctx := context.Background()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := pgstore.MigrateSchema(ctx, pool, schema); err != nil {
		t.Fatalf("MigrateSchema: %v", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE `+schema+`.effects (name text NOT NULL)`); err != nil {
		t.Fatalf("creating effects: %v", err)
	}
	return pool, schema
}

// runConformance runs the conformance suite on stores whose pools
// newPool makes, migrated, with the table effects, in the schema it
// returns ("": the one the pool's search_path selects). The handler's
// statements and the count are sent in handlerMode (0: the pool's).
func runConformance(t *testing.T, handlerMode pgx.QueryExecMode, newPool func(t *testing.T) (*pgxpool.Pool, string)) {
	type store struct {
		pool    *pgxpool.Pool
		effects string
	}
	var stores sync.Map // *pgstore.Store → store
	newStore := func(t *testing.T, now func() time.Time) idem.Store {
		pool, schema := newPool(t)
		s := pgstore.New(pool, pgstore.Options{Now: now, Schema: schema})
		effects := "effects"
		if schema != "" {
			effects = schema + ".effects"
		}
		stores.Store(s, store{pool, effects})
		t.Cleanup(func() { stores.Delete(s) })
		return s
	}
	args := func(a ...any) []any {
		if handlerMode == 0 {
			return a
		}
		return append([]any{handlerMode}, a...)
	}
	storetest.Run(t, storetest.Harness{
		New:   func(t *testing.T) idem.Store { return newStore(t, nil) },
		NewAt: newStore,
		Write: func(ctx context.Context, tx idem.Tx, name string) error {
			ptx := idemdriver.UnwrapTx(tx).(*pgstore.Tx)
			v, _ := stores.Load(pgstore.TxStore(ptx))
			_, err := ptx.PgxTx().Exec(ctx, `INSERT INTO `+v.(store).effects+` (name) VALUES ($1)`, args(name)...)
			return err
		},
		HandlerCommit:   func(ctx context.Context) error { return pgEnd(ctx, pgx.Tx.Commit) },
		HandlerRollback: func(ctx context.Context) error { return pgEnd(ctx, pgx.Tx.Rollback) },
		Count: func(ctx context.Context, s idem.Store, name string) (int, error) {
			v, _ := stores.Load(s)
			var n int
			err := v.(store).pool.QueryRow(ctx, `SELECT count(*) FROM `+v.(store).effects+` WHERE name = $1`, args(name)...).Scan(&n)
			return n, err
		},
	})
}

// pgEnd calls end (pgx.Tx's Commit or Rollback) on the transaction that
// pgstore.FromContext gives the handler of ctx's request.
func pgEnd(ctx context.Context, end func(pgx.Tx, context.Context) error) error {
	tx, err := pgstore.FromContext(ctx)
	if err != nil {
		return err
	}
	return end(tx, ctx)
}
