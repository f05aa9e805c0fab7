package orders

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/sqlitestore"
)

// MigrateSQLite creates or upgrades in db every table that SQLiteRepository
// writes: the outbox's (outbox.SQLite.Migrate, component "outbox"), then
// those of SQLiteMigrations (component "orders": orders, deployment,
// receipts). It is idempotent and safe to run from several processes at
// once (sqlitestore.ApplyMigrations).
func MigrateSQLite(ctx context.Context, db *sql.DB) error {
	if err := outbox.NewSQLite(db).Migrate(ctx); err != nil {
		return fmt.Errorf("orders: migrating: %w", err)
	}
	if err := sqlitestore.ApplyMigrations(ctx, db, "orders", SQLiteMigrations); err != nil {
		return fmt.Errorf("orders: migrating: %w", err)
	}
	return nil
}

// MigratePostgres creates or upgrades, in the schema that pool's
// search_path selects, every table that PostgresRepository writes: the
// outbox's (outbox.Postgres.Migrate, component "outbox"), then those of
// PostgresMigrations (component "orders": orders, deployment, receipts,
// jwt_secret).
// It is idempotent and safe to run from several instances at once
// (pgstore.ApplyMigrations, under an advisory lock).
func MigratePostgres(ctx context.Context, pool *pgxpool.Pool) error {
	if err := outbox.NewPostgres(pool).Migrate(ctx); err != nil {
		return fmt.Errorf("orders: migrating: %w", err)
	}
	if err := pgstore.ApplyMigrations(ctx, pool, "orders", PostgresMigrations); err != nil {
		return fmt.Errorf("orders: migrating: %w", err)
	}
	return nil
}
