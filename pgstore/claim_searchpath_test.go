package pgstore_test

import (
	"context"
	"testing"

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
