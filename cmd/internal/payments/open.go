package payments

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/idem-go/idem/cmd/internal/pgconfig"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/sqlitestore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultSchema is the PostgreSQL schema that an order service's
// in-process gateway keeps its tables in (see OpenPostgres), apart from
// the order service's own idempotency keys.
const DefaultSchema = "payments"

// OpenPostgres makes a durable gateway backend in schema of pool's
// database: it creates schema if it does not exist, creates or upgrades
// the idempotency store's table there (pgstore.MigrateSchema) and the
// ledger's (MigratePostgres), and returns the store and the ledger, which
// share pool, for Config.Store and Config.Ledger. Every statement of both
// names schema, so the pool's search_path plays no part, and a pooler in
// transaction mode (PgBouncer, which refuses search_path as a startup
// parameter or drops it) may stand between; an order service passes
// DefaultSchema, and a pool from PostgresPool. With schema "" the tables
// are in the schema that pool's search_path selects. It is safe to call
// from several processes at once. The caller closes pool when done with
// both.
func OpenPostgres(ctx context.Context, pool *pgxpool.Pool, schema string) (*pgstore.Store, *PGLedger, error) {
	if err := pgstore.MigrateSchema(ctx, pool, schema); err != nil {
		return nil, nil, fmt.Errorf("payments: %w", err)
	}
	if err := MigratePostgres(ctx, pool, schema); err != nil {
		return nil, nil, fmt.Errorf("payments: %w", err)
	}
	return pgstore.New(pool, pgstore.Options{Schema: schema}), NewPGLedger(pool, schema), nil
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

// ErrSchemaNotCurrent is matched (errors.Is) by the error of
// OpenExistingSQLite and OpenExistingPostgres when the gateway's tables
// are missing or older than this binary's: OpenSQLite or OpenPostgres
// (which migrate) brings them up to date.
var ErrSchemaNotCurrent = errors.New("payments: the gateway's schema is missing or not up to date")

// OpenExistingSQLite is OpenSQLite for a database that must exist and be
// up to date: it creates no file and applies no migration. A missing file
// is an error matching sqlitestore.ErrNoDatabase; a file whose store or
// ledger has a migration pending, one matching ErrSchemaNotCurrent that
// names them.
func OpenExistingSQLite(ctx context.Context, path string) (*sqlitestore.Store, *SQLiteLedger, error) {
	st, err := sqlitestore.OpenExisting(ctx, path, sqlitestore.Options{})
	if err != nil {
		return nil, nil, fmt.Errorf("payments: %w", err)
	}
	var pending []string
	own, err := sqlitestore.Pending(ctx, st.DB())
	if err == nil {
		pending = append(pending, prefixed(sqlitestore.Component, own)...)
		own, err = sqlitestore.PendingMigrations(ctx, st.DB(), Component, migrationsFor("sqlite"))
		pending = append(pending, prefixed(Component, own)...)
	}
	if err == nil && len(pending) > 0 {
		err = fmt.Errorf("%w: %s pending", ErrSchemaNotCurrent, strings.Join(pending, ", "))
	}
	if err != nil {
		st.Close()
		return nil, nil, fmt.Errorf("payments: %s: %w", path, err)
	}
	return st, NewSQLiteLedger(st.DB()), nil
}

// OpenExistingPostgres is OpenPostgres for a schema that must exist and
// be up to date: it creates no schema or table and applies no migration.
// A schema without the gateway's tables, or with a migration of its store
// or ledger pending, is an error matching ErrSchemaNotCurrent that names
// them.
func OpenExistingPostgres(ctx context.Context, pool *pgxpool.Pool, schema string) (*pgstore.Store, *PGLedger, error) {
	var pending []string
	own, err := pgstore.PendingSchema(ctx, pool, schema)
	if err == nil {
		pending = append(pending, prefixed(pgstore.Component, own)...)
		own, err = pgstore.PendingMigrationsSchema(ctx, pool, schema, Component, migrationsFor("postgres"))
		pending = append(pending, prefixed(Component, own)...)
	}
	if err == nil && len(pending) > 0 {
		err = fmt.Errorf("%w: %s pending", ErrSchemaNotCurrent, strings.Join(pending, ", "))
	}
	if err != nil {
		return nil, nil, fmt.Errorf("payments: %w", err)
	}
	return pgstore.New(pool, pgstore.Options{Schema: schema}), NewPGLedger(pool, schema), nil
}

// prefixed names each migration with its component: "payments/0002_refunds.sql".
func prefixed(component string, names []string) []string {
	out := make([]string, len(names))
	for i, n := range names {
		out[i] = component + "/" + n
	}
	return out
}

// PostgresPool returns a pool for databaseURL (a postgres:// URL or a
// key=value connection string, as pgxpool.ParseConfig reads it) for a
// gateway whose tables are in schema (OpenPostgres with the same schema).
// The pool gets pgconfig.Apply's settings (client_encoding UTF8, and
// pgx's query mode cache_describe unless databaseURL names one), which
// work through a pooler in transaction mode as on a direct connection.
// With schema set, the pool sends no search_path, not even one that
// databaseURL names: the gateway's statements name schema, and PgBouncer
// refuses search_path as a startup parameter. With schema "" a search_path
// in databaseURL is kept, and selects the tables. PostgresPool checks that
// the database answers; the caller closes the pool.
func PostgresPool(ctx context.Context, databaseURL, schema string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("payments: database URL: %w", err)
	}
	if schema != "" {
		delete(cfg.ConnConfig.RuntimeParams, "search_path")
	}
	pgconfig.Apply(cfg, databaseURL)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("payments: connecting to PostgreSQL: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("payments: connecting to PostgreSQL: %w", err)
	}
	return pool, nil
}
