package pgstore_test

import (
	"context"
	"testing"

	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestClaimUsesTheTableItsSearchPathSelects: with Options.Schema "", the
// store's statements name idempotency_keys unqualified, so the pool's
// search_path selects the table. The claim must write to that same table,
// even when another schema later on the search_path holds an idem_claim
// of its own (its own table migrated to 0006) while the first schema's
// table is not yet migrated to 0006: otherwise the claim's lease is on
// one table and the handler's Complete, Release and Fail, and the
// completer, work on the other, where the lease does not exist (fenced:
// the handler's order rolls back after its payment).
func TestClaimUsesTheTableItsSearchPathSelects(t *testing.T) {
	ctx := context.Background()
	url, first := pgtest.SchemaName(t)
	_, second := pgtest.SchemaName(t)
	admin := pgtest.PoolOn(t, url)
	for _, schema := range []string{first, second} {
		if err := pgstore.MigrateSchema(ctx, admin, schema); err != nil {
			t.Fatal(err)
		}
	}
	// The first schema is still at 0005: no idem_claim of its own.
	if _, err := admin.Exec(ctx, `DROP FUNCTION `+pgx.Identifier{first, "idem_claim"}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	pool := pgtest.PoolOn(t, url, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["search_path"] = first + ", " + second
	})
	s := pgstore.New(pool, pgstore.Options{})
	c, err := s.Claim(ctx, claimParams("split"))
	if err != nil || c.Lease == nil {
		t.Fatalf("claim: %+v, %v; want a lease", c, err)
	}
	count := func(schema string) int {
		var n int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "idempotency_keys"}.Sanitize()).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n, m := count(first), count(second); n != 1 || m != 0 {
		t.Errorf("rows: %d in the search_path's first schema (the store's table), %d in the second; want 1 and 0", n, m)
	}
	if err := s.Release(ctx, c.Lease); err != nil {
		t.Errorf("Release of the claimed lease: %v", err)
	}
}

// TestClaimIgnoresATemporaryTableOfTheSameName: with Options.Schema set,
// every statement names the schema's table, so a temporary table named
// idempotency_keys in the session (searched first for unqualified names)
// changes nothing; the claim must not write to it either.
func TestClaimIgnoresATemporaryTableOfTheSameName(t *testing.T) {
	ctx := context.Background()
	url, schema := pgtest.SchemaName(t)
	admin := pgtest.PoolOn(t, url)
	if err := pgstore.MigrateSchema(ctx, admin, schema); err != nil {
		t.Fatal(err)
	}
	pool := pgtest.PoolOn(t, url, pgtest.MaxConns(1), func(c *pgxpool.Config) {
		c.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
			_, err := conn.Exec(ctx, `CREATE TEMPORARY TABLE idempotency_keys (LIKE `+pgx.Identifier{schema, "idempotency_keys"}.Sanitize()+` INCLUDING ALL)`)
			return err
		}
	})
	s := pgstore.New(pool, pgstore.Options{Schema: schema})
	c, err := s.Claim(ctx, claimParams("temp"))
	if err != nil || c.Lease == nil {
		t.Fatalf("claim: %+v, %v; want a lease", c, err)
	}
	var n int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "idempotency_keys"}.Sanitize()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Errorf("%d rows in the store's table, want 1", n)
	}
	if err := s.Release(ctx, c.Lease); err != nil {
		t.Errorf("Release of the claimed lease: %v", err)
	}
}

// TestClaimStoresSideBySide runs two stores on one database, each with
// its table and idem_claim in a schema of its own: one named by
// Options.Schema while the pool's search_path selects the other's, whose
// store has Options.Schema "". A claim of the same key through each gets
// a lease in its own table, by its own idem_claim; the same behind
// PgBouncer in transaction mode for two stores with Options.Schema set.
func TestClaimStoresSideBySide(t *testing.T) {
	ctx := context.Background()
	check := func(t *testing.T, admin *pgxpool.Pool, stores map[string]*pgstore.Store) {
		t.Helper()
		leases := map[string]*idemdriver.Lease{}
		for schema, s := range stores {
			c, err := s.Claim(ctx, claimParams("same-key"))
			if err != nil || c.Lease == nil {
				t.Fatalf("claim through the store of %s: %+v, %v; want a lease", schema, c, err)
			}
			leases[schema] = c.Lease
		}
		for schema, s := range stores {
			var owner string
			if err := admin.QueryRow(ctx, `SELECT owner FROM `+pgx.Identifier{schema, "idempotency_keys"}.Sanitize()+` WHERE key = 'same-key'`).Scan(&owner); err != nil {
				t.Fatalf("the row in %s: %v", schema, err)
			}
			if owner != leases[schema].Owner {
				t.Errorf("%s's row is owned by %s, want its store's lease %s", schema, owner, leases[schema].Owner)
			}
			if !pgstore.ClaimFuncInUse(s) {
				t.Errorf("the store of %s fell back to the insert-or-read statement", schema)
			}
			if err := s.Release(ctx, leases[schema]); err != nil {
				t.Errorf("Release through the store of %s: %v", schema, err)
			}
		}
	}
	t.Run("search_path", func(t *testing.T) {
		url, named := pgtest.SchemaName(t)
		pool := migratedPool(t)
		if err := pgstore.MigrateSchema(ctx, pool, named); err != nil {
			t.Fatal(err)
		}
		var current string
		if err := pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&current); err != nil {
			t.Fatal(err)
		}
		check(t, pgtest.PoolOn(t, url), map[string]*pgstore.Store{
			named:   pgstore.New(pool, pgstore.Options{Schema: named}),
			current: pgstore.New(pool, pgstore.Options{}),
		})
	})
	t.Run("pgbouncer", func(t *testing.T) {
		url := pgtest.NewBouncer(t).URL("")
		pool, a := schemaPool(t, url)
		_, b := schemaPool(t, url)
		check(t, pool, map[string]*pgstore.Store{
			a: pgstore.New(pool, pgstore.Options{Schema: a}),
			b: pgstore.New(pool, pgstore.Options{Schema: b}),
		})
	})
}

// TestClaimInASchemaWithQuotesInItsName: the call of idem_claim names
// the store's table in a string literal; a schema whose name holds
// quotes, a backslash and a space still claims through the function, in
// its own table, in each of pgx's modes.
func TestClaimInASchemaWithQuotesInItsName(t *testing.T) {
	ctx := context.Background()
	url, base := pgtest.SchemaName(t)
	schema := base + ` o'dd "q" \ x`
	admin := pgtest.PoolOn(t, url)
	t.Cleanup(func() {
		if _, err := admin.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`); err != nil {
			t.Error(err)
		}
	})
	if err := pgstore.MigrateSchema(ctx, admin, schema); err != nil {
		t.Fatal(err)
	}
	for _, m := range execModes {
		pool := pgtest.PoolOn(t, url, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = m.mode })
		s := pgstore.New(pool, pgstore.Options{Schema: schema})
		c, err := s.Claim(ctx, claimParams("quoted"))
		if err != nil || c.Lease == nil {
			t.Fatalf("%s: claim: %+v, %v; want a lease", m.name, c, err)
		}
		if !pgstore.ClaimFuncInUse(s) {
			t.Errorf("%s: the claim fell back to the insert-or-read statement", m.name)
		}
		if err := s.Release(ctx, c.Lease); err != nil {
			t.Errorf("%s: Release: %v", m.name, err)
		}
	}
}
