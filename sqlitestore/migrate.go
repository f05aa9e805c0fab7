package sqlitestore

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"slices"
	"strconv"
	"time"
)

// migrationName is the form of a migration file: a version number, an
// underscore, a name, ".sql". For example 0001_idempotency_keys.sql.
var migrationName = regexp.MustCompile(`^([0-9]+)_[^/]+\.sql$`)

type migration struct {
	version int64
	name    string
}

// ApplyMigrations brings the schema of component up to date with the
// migrations in fsys and is safe to call again, and from several processes
// at once.
//
// The migrations are the files at the root of fsys named NNNN_name.sql (see
// [fs.Sub] to use a folder of an embedded file system); other files are
// ignored. They run in version order, each in its own transaction, and each
// file may hold several statements. Applied versions are recorded per
// component in the table schema_migrations(component, version), which is
// created if it does not exist, so several components may keep their
// schemas in one database. A version recorded in the table is never run
// again, and versions recorded there that fsys does not know are left alone.
//
// The claim on a version is the INSERT of its row in schema_migrations, made
// first in the migration's transaction: a second migrator waits for the
// first one's write lock (under busy_timeout) and then finds the version
// taken.
func ApplyMigrations(ctx context.Context, db *sql.DB, component string, fsys fs.FS) error {
	if component == "" {
		return errors.New("sqlitestore: ApplyMigrations: empty component")
	}
	migs, err := readMigrations(fsys)
	if err != nil {
		return fmt.Errorf("sqlitestore: migrations of %s: %w", component, err)
	}
	const createTable = `CREATE TABLE IF NOT EXISTS schema_migrations (
		component  TEXT    NOT NULL,
		version    INTEGER NOT NULL,
		name       TEXT    NOT NULL,
		applied_at INTEGER NOT NULL, -- Unix nanoseconds
		PRIMARY KEY (component, version)
	)`
	if _, err := db.ExecContext(ctx, createTable); err != nil {
		return interpretError("create schema_migrations", err)
	}
	for _, m := range migs {
		if err := applyMigration(ctx, db, component, fsys, m); err != nil {
			return err
		}
	}
	return nil
}

// readMigrations lists the migrations at the root of fsys in version order.
func readMigrations(fsys fs.FS) ([]migration, error) {
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return nil, err
	}
	var migs []migration
	seen := make(map[int64]string)
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		m := migrationName.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		v, err := strconv.ParseInt(m[1], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("%s: bad version: %w", e.Name(), err)
		}
		if other, ok := seen[v]; ok {
			return nil, fmt.Errorf("%s and %s have the same version %d", other, e.Name(), v)
		}
		seen[v] = e.Name()
		migs = append(migs, migration{version: v, name: e.Name()})
	}
	slices.SortFunc(migs, func(a, b migration) int { return cmp.Compare(a.version, b.version) })
	return migs, nil
}

// applyMigration runs m unless it was applied, recording it in the same
// transaction.
func applyMigration(ctx context.Context, db *sql.DB, component string, fsys fs.FS, m migration) (err error) {
	body, err := fs.ReadFile(fsys, m.name)
	if err != nil {
		return fmt.Errorf("sqlitestore: migration %s/%s: %w", component, m.name, err)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return interpretError("migration "+component+"/"+m.name, err)
	}
	defer tx.Rollback()
	res, err := tx.ExecContext(ctx,
		`INSERT INTO schema_migrations (component, version, name, applied_at) VALUES (?, ?, ?, ?)
		 ON CONFLICT (component, version) DO NOTHING`,
		component, m.version, m.name, time.Now().UnixNano())
	if err != nil {
		return interpretError("migration "+component+"/"+m.name, err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return interpretError("migration "+component+"/"+m.name, err)
	} else if n == 0 {
		return nil // applied before
	}
	if _, err := tx.ExecContext(ctx, string(body)); err != nil {
		return interpretError("migration "+component+"/"+m.name, err)
	}
	if err := tx.Commit(); err != nil {
		return interpretError("migration "+component+"/"+m.name, err)
	}
	return nil
}

// Pending returns the store's own migrations (component Component, the
// ones Open applies) that db has not applied, by file name in version
// order: all of them on a database without the store's table, none on
// one that Open brought up to date. It creates and changes nothing: see
// PendingMigrations.
func Pending(ctx context.Context, db *sql.DB) ([]string, error) {
	sub, err := fs.Sub(migrations, "migrations")
	if err != nil {
		return nil, fmt.Errorf("sqlitestore: %w", err)
	}
	return PendingMigrations(ctx, db, Component, sub)
}

// PendingMigrations returns the migrations of component found in fsys
// (named as for ApplyMigrations) that db's table schema_migrations does
// not record, by file name in version order: every one of them when the
// table does not exist. It only reads, creating no table, so that a
// command that must not change a database can tell whether its schema is
// there and up to date (nil: ApplyMigrations would apply nothing).
// Versions the table records that fsys does not know (a newer binary's)
// are not reported.
func PendingMigrations(ctx context.Context, db *sql.DB, component string, fsys fs.FS) ([]string, error) {
	if component == "" {
		return nil, errors.New("sqlitestore: PendingMigrations: empty component")
	}
	migs, err := readMigrations(fsys)
	if err != nil {
		return nil, fmt.Errorf("sqlitestore: migrations of %s: %w", component, err)
	}
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'`).Scan(&n); err != nil {
		return nil, interpretError("look for schema_migrations", err)
	}
	applied := make(map[int64]bool)
	if n > 0 {
		rows, err := db.QueryContext(ctx, `SELECT version FROM schema_migrations WHERE component = ?`, component)
		if err != nil {
			return nil, interpretError("read schema_migrations", err)
		}
		defer rows.Close()
		for rows.Next() {
			var v int64
			if err := rows.Scan(&v); err != nil {
				return nil, interpretError("read schema_migrations", err)
			}
			applied[v] = true
		}
		if err := rows.Err(); err != nil {
			return nil, interpretError("read schema_migrations", err)
		}
	}
	var pending []string
	for _, m := range migs {
		if !applied[m.version] {
			pending = append(pending, m.name)
		}
	}
	return pending, nil
}
