package sqliteoutbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/outbox/outboxtest"
	"github.com/idem-go/idem/outbox/sqliteoutbox"
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
func sqliteTable(t testing.TB) (*sqliteoutbox.Table, *sql.DB, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "outbox.db")
	db := openSQLite(t, path)
	tb := sqliteoutbox.New(db)
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
				// The application's writer takes its turn in the pool's
				// write queue, with the relay's Takes of this pool.
				unlock, err := sqlitestore.LockWrites(ctx, db)
				if err != nil {
					return err
				}
				defer unlock()
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
			Instance: func(t *testing.T) outbox.Table { return sqliteoutbox.New(openSQLite(t, path)) },
		}
	})
}

// TestSQLiteMigrateConcurrent: processes that start at once (each its own
// pool on one file) all migrate without error, and again later.
func TestSQLiteMigrateConcurrent(t *testing.T) {
	path := t.TempDir() + "/m.db"
	var dbs []*sql.DB
	for range 4 {
		dbs = append(dbs, openSQLite(t, path))
	}
	outboxtest.MigrateConcurrently(t, func(i int) error { return sqliteoutbox.New(dbs[i]).Migrate(context.Background()) }, len(dbs))
	want := outboxtest.MigrationFiles(t)
	var n int
	if err := dbs[0].QueryRow(`SELECT count(*) FROM schema_migrations WHERE component = ?`, outbox.Component).Scan(&n); err != nil || n != want {
		t.Fatalf("outbox versions recorded: %d, %v; want %d (the files in migrations/)", n, err, want)
	}
}

func TestSQLiteSlowBroker(t *testing.T) {
	tb, db, _ := sqliteTable(t)
	tb.PublishTimeout = 50 * time.Millisecond
	outboxtest.SlowBroker(t, tb, func(es ...outbox.Event) { addCommitted(t, tb, db, es...) }, func(id string) int {
		var n int
		if err := db.QueryRow(`SELECT attempts FROM idem_outbox WHERE id = ?`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	})
}

// TestSQLiteTakeWaitsForWriter: a Take with an event to publish that
// finds the database's write lock held (a request's transaction, begun
// IMMEDIATE as sqlitestore does, on a connection that did not wait in the
// pool's write queue) waits for it under busy_timeout, and then publishes
// what was committed before it and what that transaction committed.
func TestSQLiteTakeWaitsForWriter(t *testing.T) {
	ctx := context.Background()
	tb, db, _ := sqliteTable(t)
	addCommitted(t, tb, db, outbox.Event{ID: "w0", Subject: "s"})
	tx, err := db.BeginTx(ctx, nil) // IMMEDIATE: sqlitestore's pool sets _txlock=immediate
	if err != nil {
		t.Fatal(err)
	}
	if err := tb.Add(ctx, tx, outbox.Event{ID: "w1", Subject: "s"}); err != nil {
		t.Fatal(err)
	}
	type result struct {
		n   int
		err error
		ids []string
	}
	done := make(chan result, 1)
	go func() {
		var ids []string
		n, err := tb.Take(ctx, 10, func(_ context.Context, e outbox.Event) error { ids = append(ids, e.ID); return nil })
		done <- result{n, err, ids}
	}()
	select {
	case r := <-done:
		t.Fatalf("Take returned %+v while a writer held the lock", r)
	case <-time.After(50 * time.Millisecond):
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.n != 2 || r.err != nil || fmt.Sprint(r.ids) != "[w0 w1]" {
		t.Fatalf("Take after the writer committed = %+v; want 2 events, w0 and w1", r)
	}
}

// TestSQLiteIdleTakeLeavesTheLock: a Take that finds no unsent event
// returns 0 at once, without waiting for the write lock that a writer
// holds (nor taking it): an idle relay does not hold up the database's
// writers, whatever its interval.
func TestSQLiteIdleTakeLeavesTheLock(t *testing.T) {
	ctx := context.Background()
	tb, db, _ := sqliteTable(t)
	e := outbox.Event{ID: "sent", Subject: "s"}
	addCommitted(t, tb, db, e)
	if n, err := tb.Take(ctx, 10, func(context.Context, outbox.Event) error { return nil }); n != 1 || err != nil {
		t.Fatalf("first Take = %d, %v; want 1 event", n, err)
	}
	tx, err := db.BeginTx(ctx, nil) // holds the write lock, with an event not yet committed
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if err := tb.Add(ctx, tx, outbox.Event{ID: "uncommitted", Subject: "s"}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		n, err := tb.Take(ctx, 10, func(_ context.Context, e outbox.Event) error {
			return fmt.Errorf("published %s, which is not committed", e.ID)
		})
		if err == nil && n != 0 {
			err = fmt.Errorf("sent %d events", n)
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("idle Take beside a writer: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("an idle Take waited for the writer's lock")
	}
}

// addCommitted adds es to tb in a transaction of their own on db.
func addCommitted(t *testing.T, tb *sqliteoutbox.Table, db *sql.DB, es ...outbox.Event) {
	t.Helper()
	tx, err := db.BeginTx(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	for _, e := range es {
		if err := tb.Add(context.Background(), tx, e); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
}

// Pending lists the table's migrations before Migrate, creating nothing,
// and none after it.
func TestPending(t *testing.T) {
	ctx := context.Background()
	t.Run("SQLite", func(t *testing.T) {
		db := openSQLite(t, filepath.Join(t.TempDir(), "outbox.db"))
		tb := sqliteoutbox.New(db)
		if got, err := tb.Pending(ctx); err != nil || len(got) == 0 {
			t.Fatalf("before Migrate: %v, %v; want the table's migrations", got, err)
		}
		var n int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_master WHERE name = 'outbox'`).Scan(&n); err != nil || n != 0 {
			t.Fatalf("Pending created the table (%d, %v)", n, err)
		}
		if err := tb.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		if got, err := tb.Pending(ctx); err != nil || got != nil {
			t.Errorf("after Migrate: %v, %v; want none", got, err)
		}
	})
}

// BenchmarkTake measures the relay's side of the outbox: b.N events,
// added beforehand (untimed), go through Take with a publisher that does
// nothing, Batch events per Take, and the figure is events/s. The keys
// case says how many ordering keys the events spread over: "distinct"
// (every event its own key, as with many users) fills every batch;
// with fewer keys than the batch a Take sends one event per key.
func BenchmarkTake(b *testing.B) {
	for _, keys := range []int{0, 10} {
		name := "keys=distinct"
		if keys > 0 {
			name = fmt.Sprintf("keys=%d", keys)
		}
		b.Run("sqlite/"+name, func(b *testing.B) {
			tb, db, _ := sqliteTable(b)
			outboxtest.BenchTake(b, tb, keys, func(ctx context.Context, es []outbox.Event) error {
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					return err
				}
				defer tx.Rollback()
				for _, e := range es {
					if err := tb.Add(ctx, tx, e); err != nil {
						return err
					}
				}
				return tx.Commit()
			})
		})
	}
}
