package outbox_test

import (
	"context"
	"database/sql"
	neturl "net/url"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/outbox/outboxtest"
	"github.com/idem-go/idem/sqlitestore"
)

// openSQLite opens (creating it) the database at path as the order
// service does, through sqlitestore.Open, closed when t ends.
func openSQLite(t testing.TB, path string) *sql.DB {
	t.Helper()
	st, err := sqlitestore.Open(context.Background(), path, sqlitestore.Options{})
	if err != nil {
		t.Fatalf("sqlitestore.Open: %v", err)
	}
	t.Cleanup(func() { st.Close() })
	return st.DB()
}

// sqliteTable returns a migrated outbox table in a new SQLite file, and
// the file's path.
func sqliteTable(t testing.TB) (*outbox.SQLite, *sql.DB, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "outbox.db")
	db := openSQLite(t, path)
	tb := outbox.NewSQLite(db)
	if err := tb.Migrate(context.Background()); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	return tb, db, path
}

func TestSQLite(t *testing.T) {
	outboxtest.Run(t, func(t *testing.T) outboxtest.Harness {
		tb, db, path := sqliteTable(t)
		return outboxtest.Harness{
			Table: tb,
			InTx: func(ctx context.Context, commit bool, fn func(add func(outbox.Event) error) error) error {
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					return err
				}
				defer tx.Rollback()
				if err := fn(func(e outbox.Event) error { return tb.Add(ctx, tx, e) }); err != nil {
					return err
				}
				if !commit {
					return tx.Rollback()
				}
				return tx.Commit()
			},
			Instance: func(t *testing.T) outbox.Table { return outbox.NewSQLite(openSQLite(t, path)) },
		}
	})
}

// pgTable returns a migrated outbox table in a new schema.
func pgTable(t testing.TB) (*outbox.Postgres, *pgxpool.Pool) {
	t.Helper()
	pool := pgtest.Pool(t)
	tb := outbox.NewPostgres(pool)
	if err := tb.Migrate(context.Background()); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	return tb, pool
}

// samePool opens another pool like pool (same server, same schema),
// closed when t ends.
func samePool(t testing.TB, pool *pgxpool.Pool) *pgxpool.Pool {
	t.Helper()
	other, err := pgxpool.NewWithConfig(context.Background(), pool.Config())
	if err != nil {
		t.Fatalf("another pool: %v", err)
	}
	t.Cleanup(other.Close)
	return other
}

func TestPostgres(t *testing.T) {
	outboxtest.Run(t, func(t *testing.T) outboxtest.Harness {
		tb, pool := pgTable(t)
		return outboxtest.Harness{
			Table: tb,
			InTx: func(ctx context.Context, commit bool, fn func(add func(outbox.Event) error) error) error {
				tx, err := pool.Begin(ctx)
				if err != nil {
					return err
				}
				defer tx.Rollback(ctx)
				if err := fn(func(e outbox.Event) error { return tb.Add(ctx, tx, e) }); err != nil {
					return err
				}
				if !commit {
					return tx.Rollback(ctx)
				}
				return tx.Commit(ctx)
			},
			Instance: func(t *testing.T) outbox.Table { return outbox.NewPostgres(samePool(t, pool)) },
		}
	})
}

// TestPostgresBehindPgBouncer runs the suite on pools with pgx's default
// settings (named prepared statements for a caller's own statements)
// through PgBouncer in transaction pooling mode, each case on a database
// of its own (PgBouncer refuses search_path, so the table is in public).
// The table's statements choose a mode without named statements; with
// pgx's default they failed here (prepared statement … already exists,
// or does not exist).
func TestPostgresBehindPgBouncer(t *testing.T) {
	b := pgtest.NewBouncer(t)
	outboxtest.Run(t, func(t *testing.T) outboxtest.Harness {
		u, err := neturl.Parse(pgtest.Database(t))
		if err != nil {
			t.Fatal(err)
		}
		url := b.URL(strings.TrimPrefix(u.Path, "/"))
		open := func(t *testing.T) *pgxpool.Pool {
			pool, err := pgxpool.New(context.Background(), url)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			return pool
		}
		pool := open(t)
		tb := outbox.NewPostgres(pool)
		if err := tb.Migrate(context.Background()); err != nil {
			t.Fatalf("Migrate: %v", err)
		}
		return outboxtest.Harness{
			Table: tb,
			InTx: func(ctx context.Context, commit bool, fn func(add func(outbox.Event) error) error) error {
				tx, err := pool.Begin(ctx)
				if err != nil {
					return err
				}
				defer tx.Rollback(ctx)
				if err := fn(func(e outbox.Event) error { return tb.Add(ctx, tx, e) }); err != nil {
					return err
				}
				if !commit {
					return tx.Rollback(ctx)
				}
				return tx.Commit(ctx)
			},
			Instance: func(t *testing.T) outbox.Table { return outbox.NewPostgres(open(t)) },
		}
	})
}

// TestPostgresAddInSavepoint: Add works in a savepoint of the caller's
// transaction, and a savepoint rolled back takes its event with it.
func TestPostgresAddInSavepoint(t *testing.T) {
	ctx := context.Background()
	tb, pool := pgTable(t)
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error {
			return tb.Add(ctx, sp, outbox.Event{ID: "kept", Subject: "s"})
		}); err != nil {
			return err
		}
		sp, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		if err := tb.Add(ctx, sp, outbox.Event{ID: "dropped", Subject: "s"}); err != nil {
			return err
		}
		return sp.Rollback(ctx)
	})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := tb.Unsent(ctx); n != 1 || err != nil {
		t.Fatalf("Unsent = %d, %v; want 1 (the rolled-back savepoint's event gone)", n, err)
	}
}
