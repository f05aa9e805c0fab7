package pgstore_test

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
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
// schema of its own, once for each of pgx's query modes set as the pool's
// default.
func TestConformance(t *testing.T) {
	for _, m := range selectedExecModes(t) {
		t.Run(m.name, func(t *testing.T) {
			t.Parallel()
			runConformance(t, func(t *testing.T) *pgxpool.Pool {
				return migratedPool(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = m.mode })
			})
		})
	}
}

// runConformance runs the conformance suite on stores whose pools
// newPool makes: migrated, with the table effects.
func runConformance(t *testing.T, newPool func(t *testing.T) *pgxpool.Pool) {
	var pools sync.Map // *pgstore.Store → *pgxpool.Pool
	newStore := func(t *testing.T, now func() time.Time) idem.Store {
		pool := newPool(t)
		s := pgstore.New(pool, pgstore.Options{Now: now})
		pools.Store(s, pool)
		t.Cleanup(func() { pools.Delete(s) })
		return s
	}
	storetest.Run(t, storetest.Harness{
		New:   func(t *testing.T) idem.Store { return newStore(t, nil) },
		NewAt: newStore,
		Write: func(ctx context.Context, tx idem.Tx, name string) error {
			_, err := tx.(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, name)
			return err
		},
		Count: func(ctx context.Context, s idem.Store, name string) (int, error) {
			pool, _ := pools.Load(s)
			var n int
			err := pool.(*pgxpool.Pool).QueryRow(ctx, `SELECT count(*) FROM effects WHERE name = $1`, name).Scan(&n)
			return n, err
		},
	})
}

var _ = pgtest.DefaultURL
