package orders

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/outbox/pgoutbox"
	"github.com/idem-go/idem/outbox/sqliteoutbox"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/sqlitestore"
)

// MigrateSQLite creates or upgrades in db every table that SQLiteRepository
// writes: the outbox's (sqliteoutbox.Table.Migrate, component "outbox"), then
// those of SQLiteMigrations (component "orders": orders, deployment,
// receipts). It is idempotent and safe to run from several processes at
// once (sqlitestore.ApplyMigrations).
func MigrateSQLite(ctx context.Context, db *sql.DB) error {
	if err := sqliteoutbox.New(db).Migrate(ctx); err != nil {
		return fmt.Errorf("orders: migrating: %w", err)
	}
	if err := sqlitestore.ApplyMigrations(ctx, db, "orders", SQLiteMigrations); err != nil {
		return fmt.Errorf("orders: migrating: %w", err)
	}
	return nil
}

// MigratePostgres creates or upgrades, in the schema that pool's
// search_path selects, every table that PostgresRepository writes: the
// outbox's (pgoutbox.Table.Migrate, component "outbox"), then those of
// PostgresMigrations (component "orders": orders, deployment, receipts,
// jwt_secret).
// It is idempotent and safe to run from several instances at once
// (pgstore.ApplyMigrations, under an advisory lock).
func MigratePostgres(ctx context.Context, pool *pgxpool.Pool) error {
	if err := pgoutbox.New(pool).Migrate(ctx); err != nil {
		return fmt.Errorf("orders: migrating: %w", err)
	}
	if err := pgstore.ApplyMigrations(ctx, pool, "orders", PostgresMigrations); err != nil {
		return fmt.Errorf("orders: migrating: %w", err)
	}
	return nil
}

// Pending is what a database lacks of a schema: the migrations not yet
// applied, by component, each list by file name in version order.
type Pending map[string][]string

// Empty reports whether nothing is pending: the schema is up to date.
func (p Pending) Empty() bool {
	for _, names := range p {
		if len(names) > 0 {
			return false
		}
	}
	return true
}

// PendingSQLite reports the migrations of MigrateSQLite (components
// "outbox" and "orders") that db has not applied, reading only: it
// creates no table (sqlitestore.PendingMigrations). A component without
// any pending migration is left out.
func PendingSQLite(ctx context.Context, db *sql.DB) (Pending, error) {
	p := Pending{}
	out, err := sqliteoutbox.New(db).Pending(ctx)
	if err != nil {
		return nil, fmt.Errorf("orders: %w", err)
	}
	p.add(outbox.Component, out)
	own, err := sqlitestore.PendingMigrations(ctx, db, "orders", SQLiteMigrations)
	if err != nil {
		return nil, fmt.Errorf("orders: %w", err)
	}
	p.add("orders", own)
	return p, nil
}

// PendingPostgres reports the migrations of MigratePostgres (components
// "outbox" and "orders") that the schema pool's search_path selects has
// not applied, reading only (pgstore.PendingMigrations). A component
// without any pending migration is left out.
func PendingPostgres(ctx context.Context, pool *pgxpool.Pool) (Pending, error) {
	p := Pending{}
	out, err := pgoutbox.New(pool).Pending(ctx)
	if err != nil {
		return nil, fmt.Errorf("orders: %w", err)
	}
	p.add(outbox.Component, out)
	own, err := pgstore.PendingMigrations(ctx, pool, "orders", PostgresMigrations)
	if err != nil {
		return nil, fmt.Errorf("orders: %w", err)
	}
	p.add("orders", own)
	return p, nil
}

func (p Pending) add(component string, names []string) {
	if len(names) > 0 {
		p[component] = names
	}
}
