package pgstore_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5"
)

// FINDING (adversarial review): MigrateSchema(schema) must take the
// migration lock that an instance whose search_path selects schema takes
// (Migrate, and every instance before MigrateSchema existed:
// hashtext(current_schema())), or the two migrate the same schema at
// once during a rolling upgrade. It hashes the name as given, while
// current_schema() is the name PostgreSQL kept: an identifier longer than
// 63 bytes is truncated (CREATE SCHEMA, search_path), so for such a name
// the two locks differ.
func TestMigrateSchemaTakesTheLockOfSearchPathInstances(t *testing.T) {
	t.Parallel()
	for name, schema := range map[string]string{
		"short": "idem_lock_short_" + randomSuffix(),
		"long":  "idem_lock_long_" + strings.Repeat("x", 60) + "_" + randomSuffix(),
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url := pgtest.URL(t)
			kept := schema
			if len(kept) > 63 {
				kept = kept[:63]
			}
			t.Cleanup(func() {
				c, err := pgx.Connect(context.Background(), url)
				if err == nil {
					if _, err := c.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{kept}.Sanitize()+` CASCADE`); err != nil {
						t.Errorf("dropping schema %s: %v", kept, err)
					}
					c.Close(context.Background())
				}
			})
			pool := pgtest.PoolOn(t, url, pgtest.MaxConns(2))

			// An instance whose search_path selects the schema, in the
			// middle of its migration: it holds the lock as Migrate takes it.
			holder, err := pgx.Connect(ctx, url)
			if err != nil {
				t.Fatal(err)
			}
			defer holder.Close(ctx)
			if _, err := holder.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{schema}.Sanitize()); err != nil {
				t.Fatal(err)
			}
			htx, err := holder.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := htx.Exec(ctx, `SET LOCAL search_path TO `+pgx.Identifier{schema}.Sanitize()); err != nil {
				t.Fatal(err)
			}
			var cur string
			if err := htx.QueryRow(ctx, `SELECT current_schema()`).Scan(&cur); err != nil || cur != kept {
				t.Fatalf("current_schema() = %q, %v; want %q", cur, err, kept)
			}
			if _, err := htx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('schema_migrations'), hashtext(coalesce(current_schema(), '')))`); err != nil {
				t.Fatal(err)
			}

			done := make(chan error, 1)
			go func() { done <- pgstore.MigrateSchema(ctx, pool, schema) }()
			select {
			case err := <-done:
				t.Fatalf("MigrateSchema(%q) returned (%v) while an instance whose search_path selects the schema held the migration lock: not the same lock", schema, err)
			case <-time.After(500 * time.Millisecond):
			}
			htx.Rollback(ctx)
			if err := <-done; err != nil {
				t.Fatalf("MigrateSchema once the lock was free: %v", err)
			}
		})
	}
}

// randomSuffix returns a short suffix that keeps parallel tests' schemas
// apart.
func randomSuffix() string {
	return strings.ReplaceAll(time.Now().Format("150405.000000000"), ".", "")
}
