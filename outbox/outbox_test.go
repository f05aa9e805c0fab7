package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	neturl "net/url"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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

// Add tries its key's lock before it waits for it in the server; two
// transactions that add events of two keys in opposite orders still end
// in a deadlock that PostgreSQL detects (one of them fails), not in two
// transactions trying for ever. And a transaction holding a key's lock
// makes another one's Add wait for it, however long.
func TestPostgresAddKeyLock(t *testing.T) {
	tb, pool := pgTable(t)
	ctx := context.Background()
	begin := func() pgx.Tx {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(ctx) })
		return tx
	}

	t.Run("waits for the holder", func(t *testing.T) {
		holder, waiter := begin(), begin()
		if err := tb.Add(ctx, holder, outbox.Event{ID: "held-1", Subject: "s", OrderingKey: "held"}); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- tb.Add(ctx, waiter, outbox.Event{ID: "held-2", Subject: "s", OrderingKey: "held"}) }()
		select {
		case err := <-done:
			t.Fatalf("Add returned (%v) while another transaction held the key", err)
		case <-time.After(time.Second): // past the polling: it waits in the server now
		}
		if err := holder.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatalf("Add after the holder committed: %v", err)
		}
		if err := waiter.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("opposite orders deadlock", func(t *testing.T) {
		a, b := begin(), begin()
		if err := tb.Add(ctx, a, outbox.Event{ID: "x-a", Subject: "s", OrderingKey: "x"}); err != nil {
			t.Fatal(err)
		}
		if err := tb.Add(ctx, b, outbox.Event{ID: "y-b", Subject: "s", OrderingKey: "y"}); err != nil {
			t.Fatal(err)
		}
		type result struct {
			tx  pgx.Tx
			err error
		}
		results := make(chan result, 2)
		go func() { results <- result{a, tb.Add(ctx, a, outbox.Event{ID: "y-a", Subject: "s", OrderingKey: "y"})} }()
		go func() { results <- result{b, tb.Add(ctx, b, outbox.Event{ID: "x-b", Subject: "s", OrderingKey: "x"})} }()
		timeout := time.After(20 * time.Second)
		var failed int
		for range 2 {
			select {
			case r := <-results:
				var pe *pgconn.PgError
				if errors.As(r.err, &pe) && pe.Code == "40P01" {
					failed++
					// The loser's transaction is aborted: its rollback
					// frees the winner, which still waits.
					_ = r.tx.Rollback(ctx)
				} else if r.err != nil {
					t.Errorf("Add: %v, want nil or a deadlock (40P01)", r.err)
				}
			case <-timeout:
				t.Fatal("two Adds in opposite key orders still waiting after 20s: no deadlock was detected")
			}
		}
		if failed == 0 {
			t.Error("neither Add failed with a deadlock")
		}
	})
}
