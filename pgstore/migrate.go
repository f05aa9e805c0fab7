package pgstore

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Component is the name under which Migrate records the store's own
// migrations in schema_migrations.
const Component = "idem"

// Migrate creates or upgrades the idempotency_keys table in the schema that
// pool's search_path selects. It is safe to call from any number of
// instances at once: see ApplyMigrations.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	return MigrateSchema(ctx, pool, "")
}

// MigrateSchema is Migrate in schema, which it creates if it does not
// exist, whatever the pool's search_path: for a Store whose
// Options.Schema is schema. With schema "" it is Migrate.
func MigrateSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return fmt.Errorf("pgstore: migrations: %w", err)
	}
	return ApplyMigrationsSchema(ctx, pool, schema, Component, sub)
}

// migrationLockTimeout bounds how long ApplyMigrations waits for a table
// lock (PostgreSQL's lock_timeout in its transaction): meanwhile, every
// statement on that table waits behind it.
const migrationLockTimeout = 5 * time.Second

// lockTimeoutError explains a migration's lock_timeout (SQLSTATE 55P03,
// lock_not_available); other errors are returned as they are.
func lockTimeoutError(err error) error {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "55P03" { // lock_not_available
		return err
	}
	return fmt.Errorf("a table lock was not granted within %v: a long transaction holds the table "+
		"(see pg_stat_activity); nothing was applied, so that the running instances' statements do not wait behind the migration; "+
		"the start fails and may be retried once that transaction ended: %w", migrationLockTimeout, err)
}

// migration is one versioned file.
type migration struct {
	version int
	name    string
	sql     string
}

// ApplyMigrations applies the migrations of component found in fsys that
// are not yet recorded in the table schema_migrations, in version order,
// and records them.
//
// The migrations are the files named *.sql at the root of fsys (pass
// fs.Sub for a folder of an embed.FS); each name begins with its version, a
// positive integer, followed by "_" or ".sql": 0001_create_orders.sql,
// 0002_add_index.sql. A file may hold several statements.
//
// Everything runs in one transaction that first takes a transaction-level
// advisory lock, scoped to the current schema, so instances that start at
// once apply each migration exactly once, and a migration that fails leaves
// no trace: the next start retries it. Because of that single transaction,
// a migration must not use statements that cannot run in a transaction
// block (CREATE INDEX CONCURRENTLY, for example).
//
// After the advisory lock, the transaction sets lock_timeout to 5 seconds
// (SET LOCAL lock_timeout = '5s'). A migration that alters a table (ALTER
// TABLE, DROP INDEX) needs an exclusive lock on it, and while it waits for
// one, every other statement on that table queues behind it: each Claim
// of every running instance. When a long transaction holds the table (an
// audit's scan, a report, pg_dump), the migration gives up after 5 seconds
// instead of stalling that traffic until the transaction ends:
// ApplyMigrations returns an error that says so, nothing is applied, and
// the start may be retried (pg_stat_activity shows the transaction). The
// advisory lock itself is taken before, without a timeout: an instance
// waits for another one's migration to finish.
//
// Its statements are sent in pgx's exec mode, whatever the pool's, and
// it needs nothing of the session beyond its transaction, so it works
// behind a pooler in transaction mode (PgBouncer's pool_mode =
// transaction).
func ApplyMigrations(ctx context.Context, pool *pgxpool.Pool, component string, fsys fs.FS) error {
	return ApplyMigrationsSchema(ctx, pool, "", component, fsys)
}

// ApplyMigrationsSchema is ApplyMigrations in schema, whatever the pool's
// search_path: it creates the schema if it does not exist and sets the
// transaction's search_path to it (SET LOCAL), so that the migrations'
// unqualified names, schema_migrations included, are schema's. With
// schema "" it is ApplyMigrations.
func ApplyMigrationsSchema(ctx context.Context, pool *pgxpool.Pool, schema, component string, fsys fs.FS) error {
	ms, err := readMigrations(fsys)
	if err != nil {
		return fmt.Errorf("pgstore: %s migrations: %w", component, err)
	}
	const mode = pgx.QueryExecModeExec // no named statement is left on a pooler's server connection
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// One lock for every component sharing schema_migrations in this
		// schema; tests that migrate separate schemas in parallel do not
		// wait on each other. With a schema named, the lock is the one an
		// instance whose search_path selects that schema takes, and it is
		// taken before the schema is created, which two instances must
		// not do at once. The name is hashed as PostgreSQL keeps it
		// (::name truncates it to 63 bytes, as CREATE SCHEMA and
		// search_path do), which is what current_schema() returns.
		lock := `SELECT pg_advisory_xact_lock(hashtext('schema_migrations'), hashtext(coalesce(current_schema(), '')))`
		var args []any
		if schema != "" {
			lock = `SELECT pg_advisory_xact_lock(hashtext('schema_migrations'), hashtext($1::text::name))`
			args = []any{mode, schema}
		}
		if _, err := tx.Exec(ctx, lock, args...); err != nil {
			return fmt.Errorf("taking the migration lock: %w", err)
		}
		if schema != "" {
			// CREATE SCHEMA IF NOT EXISTS needs the CREATE privilege on
			// the database even when the schema exists: a role that owns
			// the schema but may not create one must not need it.
			ident := pgx.Identifier{schema}.Sanitize()
			var exists bool
			if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)`, mode, schema).Scan(&exists); err != nil {
				return fmt.Errorf("looking for schema %s: %w", ident, err)
			}
			if !exists {
				if _, err := tx.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+ident); err != nil {
					return fmt.Errorf("creating schema %s: %w", ident, err)
				}
			}
			if _, err := tx.Exec(ctx, `SET LOCAL search_path TO `+ident); err != nil {
				return fmt.Errorf("setting search_path: %w", err)
			}
		}
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '`+migrationLockTimeout.String()+`'`); err != nil {
			return fmt.Errorf("setting lock_timeout: %w", err)
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
	component  text        NOT NULL,
	version    int         NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT now(),
	PRIMARY KEY (component, version)
)`); err != nil {
			return fmt.Errorf("creating schema_migrations: %w", err)
		}
		rows, err := tx.Query(ctx, `SELECT version FROM schema_migrations WHERE component = $1`, mode, component)
		if err != nil {
			return err
		}
		applied, err := pgx.CollectRows(rows, pgx.RowTo[int])
		if err != nil {
			return err
		}
		for _, m := range ms {
			if slices.Contains(applied, m.version) {
				continue
			}
			if _, err := tx.Exec(ctx, m.sql); err != nil {
				return fmt.Errorf("applying %s: %w", m.name, lockTimeoutError(err))
			}
			if _, err := tx.Exec(ctx, `INSERT INTO schema_migrations (component, version) VALUES ($1, $2)`, mode, component, m.version); err != nil {
				return fmt.Errorf("recording %s: %w", m.name, err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("pgstore: %s migrations: %w", component, err)
	}
	return nil
}

// readMigrations returns the migrations at the root of fsys, by version.
func readMigrations(fsys fs.FS) ([]migration, error) {
	names, err := fs.Glob(fsys, "*.sql")
	if err != nil {
		return nil, err
	}
	var ms []migration
	for _, name := range names {
		digits := strings.TrimSuffix(path.Base(name), ".sql")
		if i := strings.IndexByte(digits, '_'); i >= 0 {
			digits = digits[:i]
		}
		v, err := strconv.Atoi(digits)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("%s: name does not begin with a positive version number", name)
		}
		b, err := fs.ReadFile(fsys, name)
		if err != nil {
			return nil, err
		}
		ms = append(ms, migration{version: v, name: name, sql: string(b)})
	}
	slices.SortFunc(ms, func(a, b migration) int { return a.version - b.version })
	for i := 1; i < len(ms); i++ {
		if ms[i].version == ms[i-1].version {
			return nil, fmt.Errorf("%s and %s have the same version %d", ms[i-1].name, ms[i].name, ms[i].version)
		}
	}
	if len(ms) == 0 {
		return nil, fmt.Errorf("no *.sql files")
	}
	return ms, nil
}

// Pending returns the store's own migrations (component Component) that
// the schema pool's search_path selects has not applied, by file name in
// version order: all of them on a database without the store's table,
// none on one that Migrate brought up to date. It creates and changes
// nothing: see PendingMigrations.
func Pending(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	return PendingSchema(ctx, pool, "")
}

// PendingSchema is Pending in schema, whatever the pool's search_path
// (MigrateSchema's); with schema "" it is Pending.
func PendingSchema(ctx context.Context, pool *pgxpool.Pool, schema string) ([]string, error) {
	sub, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return nil, fmt.Errorf("pgstore: migrations: %w", err)
	}
	return PendingMigrationsSchema(ctx, pool, schema, Component, sub)
}

// PendingMigrations returns the migrations of component found in fsys
// (named as for ApplyMigrations) that the table schema_migrations of the
// schema pool's search_path selects does not record, by file name in
// version order: every one of them when that table, or the schema, does
// not exist. It only reads: it creates no table or schema and takes no
// lock, so that a command that must not change a database can tell
// whether its schema is there and up to date (nil: ApplyMigrations
// would apply nothing). Versions the table records that fsys does not
// know (a newer binary's) are not reported. Like ApplyMigrations it works
// behind a pooler in transaction mode.
func PendingMigrations(ctx context.Context, pool *pgxpool.Pool, component string, fsys fs.FS) ([]string, error) {
	return PendingMigrationsSchema(ctx, pool, "", component, fsys)
}

// PendingMigrationsSchema is PendingMigrations in schema, whatever the
// pool's search_path (ApplyMigrationsSchema's); with schema "" it is
// PendingMigrations.
func PendingMigrationsSchema(ctx context.Context, pool *pgxpool.Pool, schema, component string, fsys fs.FS) ([]string, error) {
	ms, err := readMigrations(fsys)
	if err != nil {
		return nil, fmt.Errorf("pgstore: %s migrations: %w", component, err)
	}
	const mode = pgx.QueryExecModeExec // as ApplyMigrations: nothing left on a pooler's server connection
	table := `quote_ident(current_schema()) || '.schema_migrations'`
	args := []any{mode}
	if schema != "" {
		table = `quote_ident($1) || '.schema_migrations'`
		args = append(args, schema)
	}
	// to_regclass is NULL, not an error, for a schema or table that does
	// not exist; current_schema() is NULL when no schema of the
	// search_path exists.
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT coalesce(to_regclass(`+table+`) IS NOT NULL, false)`, args...).Scan(&exists); err != nil {
		return nil, fmt.Errorf("pgstore: %s migrations: looking for schema_migrations: %w", component, err)
	}
	var applied []int
	if exists {
		name := `schema_migrations`
		if schema != "" {
			name = pgx.Identifier{schema, "schema_migrations"}.Sanitize()
		}
		rows, err := pool.Query(ctx, `SELECT version FROM `+name+` WHERE component = $1`, mode, component)
		if err != nil {
			return nil, fmt.Errorf("pgstore: %s migrations: reading schema_migrations: %w", component, err)
		}
		if applied, err = pgx.CollectRows(rows, pgx.RowTo[int]); err != nil {
			return nil, fmt.Errorf("pgstore: %s migrations: reading schema_migrations: %w", component, err)
		}
	}
	var pending []string
	for _, m := range ms {
		if !slices.Contains(applied, m.version) {
			pending = append(pending, m.name)
		}
	}
	return pending, nil
}
