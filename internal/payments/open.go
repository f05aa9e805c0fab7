package payments

import (
	"context"
	"errors"
	"fmt"

	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/sqlitestore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultSchema is the PostgreSQL schema that an order service's
// in-process gateway keeps its tables in (see PostgresPool), apart from the
// order service's own idempotency keys.
const DefaultSchema = "payments"

// OpenPostgres makes a durable gateway backend of pool's database, in the
// schema that pool's search_path selects: it creates or upgrades the
// idempotency store's table (pgstore.Migrate) and the ledger's
// (MigratePostgres), and returns the store and the ledger, which share
// pool, for Config.Store and Config.Ledger. It is safe to call from several
// processes at once. The caller closes pool when done with both.
func OpenPostgres(ctx context.Context, pool *pgxpool.Pool) (*pgstore.Store, *PGLedger, error) {
	if err := pgstore.Migrate(ctx, pool); err != nil {
		return nil, nil, fmt.Errorf("payments: %w", err)
	}
	if err := MigratePostgres(ctx, pool); err != nil {
		return nil, nil, fmt.Errorf("payments: %w", err)
	}
	return pgstore.New(pool, pgstore.Options{}), NewPGLedger(pool), nil
}

// OpenSQLite makes a durable gateway backend of the SQLite database file
// at path, creating it if need be: it opens the idempotency store
// (sqlitestore.Open, which applies its migrations), creates or upgrades the
// ledger's table (MigrateSQLite) and returns the store and the ledger on
// the store's database, for Config.Store and Config.Ledger. Use a file of
// the gateway's own, not the order service's: both keep a table
// idempotency_keys. Closing the store closes the ledger's database too.
func OpenSQLite(ctx context.Context, path string) (*sqlitestore.Store, *SQLiteLedger, error) {
	st, err := sqlitestore.Open(ctx, path, sqlitestore.Options{})
	if err != nil {
		return nil, nil, fmt.Errorf("payments: %w", err)
	}
	if err := MigrateSQLite(ctx, st.DB()); err != nil {
		st.Close()
		return nil, nil, fmt.Errorf("payments: %w", err)
	}
	return st, NewSQLiteLedger(st.DB()), nil
}

// PostgresPool returns a pool for databaseURL (a postgres:// URL or a
// key=value connection string, as pgxpool.ParseConfig reads it) whose
// connections use schema, creating the schema if it does not exist: the
// gateway's tables then live apart from those of another service in the
// same database (an order service passes DefaultSchema). Several processes
// may do this at once. With schema empty the pool keeps the search_path
// that databaseURL sets, or the server's default. PostgresPool checks that
// the database answers; the caller closes the pool.
func PostgresPool(ctx context.Context, databaseURL, schema string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("payments: database URL: %w", err)
	}
	ident := pgx.Identifier{schema}.Sanitize()
	if schema != "" {
		cfg.ConnConfig.RuntimeParams["search_path"] = ident
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("payments: connecting to PostgreSQL: %w", err)
	}
	if schema == "" {
		if err := pool.Ping(ctx); err != nil {
			pool.Close()
			return nil, fmt.Errorf("payments: connecting to PostgreSQL: %w", err)
		}
		return pool, nil
	}
	if err := createSchema(ctx, pool, schema, ident); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// createSchema creates schema unless it exists. CREATE SCHEMA needs the
// CREATE privilege on the database even with IF NOT EXISTS, so an existing
// schema is looked for first; two processes that create it at once may
// see unique_violation or duplicate_schema, which mean it exists.
func createSchema(ctx context.Context, pool *pgxpool.Pool, schema, ident string) error {
	var exists bool
	err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, schema).Scan(&exists)
	if err != nil {
		return fmt.Errorf("payments: connecting to PostgreSQL: %w", err)
	}
	if exists {
		return nil
	}
	_, err = pool.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+ident)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "23505" || pgErr.Code == "42P06") {
		err = nil
	}
	if err != nil {
		return fmt.Errorf("payments: creating schema %s: %w", ident, err)
	}
	return nil
}
