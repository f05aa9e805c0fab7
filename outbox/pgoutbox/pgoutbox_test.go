package pgoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/outbox/outboxtest"
	"github.com/idem-go/idem/outbox/pgoutbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pgTable returns a migrated outbox table in a new schema.
func pgTable(t testing.TB) (*pgoutbox.Table, *pgxpool.Pool) {
	t.Helper()
	pool := pgtest.Pool(t)
	tb := pgoutbox.New(pool)
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
			Instance: func(t *testing.T) outbox.Table { return pgoutbox.New(samePool(t, pool)) },
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
		u, err := url.Parse(pgtest.Database(t))
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
		tb := pgoutbox.New(pool)
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
			Instance: func(t *testing.T) outbox.Table { return pgoutbox.New(open(t)) },
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

// TestPostgresMigrateConcurrent: instances that start at once (each its
// own pool on one schema) all migrate without error, and again later.
func TestPostgresMigrateConcurrent(t *testing.T) {
	_, pool := pgTableUnmigrated(t)
	pools := []*pgxpool.Pool{pool}
	for len(pools) < 4 {
		pools = append(pools, samePool(t, pool))
	}
	outboxtest.MigrateConcurrently(t, func(i int) error { return pgoutbox.New(pools[i]).Migrate(context.Background()) }, len(pools))
	want := outboxtest.MigrationFiles(t)
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM schema_migrations WHERE component = $1`, outbox.Component).Scan(&n); err != nil || n != want {
		t.Fatalf("outbox versions recorded: %d, %v; want %d (the files in migrations/)", n, err, want)
	}
}

func pgTableUnmigrated(t *testing.T) (*pgoutbox.Table, *pgxpool.Pool) {
	t.Helper()
	pool := pgtest.Pool(t)
	return pgoutbox.New(pool), pool
}

func TestPostgresSlowBroker(t *testing.T) {
	tb, pool := pgTable(t)
	tb.PublishTimeout = 50 * time.Millisecond
	ctx := context.Background()
	outboxtest.SlowBroker(t, tb, func(es ...outbox.Event) {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			for _, e := range es {
				if err := tb.Add(ctx, tx, e); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}, func(id string) int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT attempts FROM idem_outbox WHERE id = $1`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	})
}

// TestPostgresConnectionLostBeforeMark: the broker has the event, then
// the Take's connection dies before its commit (the server ends it): the
// event stays unsent and the next pass publishes it again, same ID.
func TestPostgresConnectionLostBeforeMark(t *testing.T) {
	ctx := context.Background()
	tb, pool := pgTable(t)
	cfg := pool.Config()
	app := fmt.Sprintf("outbox_test_%d", time.Now().UnixNano())
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	relayPool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer relayPool.Close()
	relayTable := pgoutbox.New(relayPool)
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return tb.Add(ctx, tx, outbox.Event{ID: "lost-1", Subject: "s", OrderingKey: "k"})
	}); err != nil {
		t.Fatal(err)
	}
	var published []string
	var killedPID int32
	n, err := relayTable.Take(ctx, 10, func(_ context.Context, e outbox.Event) error {
		published = append(published, e.ID)
		err := pool.QueryRow(ctx, `
			SELECT pid FROM pg_stat_activity
			WHERE application_name = $1 AND state = 'idle in transaction'`, app).Scan(&killedPID)
		if err != nil {
			return fmt.Errorf("finding the relay's connection: %w", err)
		}
		var killed bool
		if err := pool.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, killedPID).Scan(&killed); err != nil || !killed {
			return fmt.Errorf("terminating the relay's connection %d: %v, %w", killedPID, killed, err)
		}
		return nil // the broker has it
	})
	if n != 0 || err == nil {
		t.Fatalf("Take whose connection died = %d, %v; want 0 and an error", n, err)
	}
	// pg_terminate_backend only signals: the backend rolls back and lets
	// go of the event's row lock as it exits. A pass before then skips the
	// locked event as held by another relay (seen in CI: the next Take
	// sent nothing), so the test waits for the backend to be gone, as a
	// relay's next pass a second later would find it.
	testwait.Until(t, 0, "the terminated relay connection's backend to exit", func() bool {
		var alive int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE pid = $1`, killedPID).Scan(&alive)
		return err == nil && alive == 0
	})
	n, err = relayTable.Take(ctx, 10, func(_ context.Context, e outbox.Event) error {
		published = append(published, e.ID)
		return nil
	})
	if n != 1 || err != nil || fmt.Sprint(published) != "[lost-1 lost-1]" {
		t.Fatalf("next Take = %d, %v, published %v; want 1, nil, [lost-1 lost-1]", n, err, published)
	}
}

// TestPostgresConcurrentAddsKeepKeyOrder: of two transactions adding
// events of one key, the one that added first commits first (Add's key
// lock makes the second wait), so a relay running between the commits
// never publishes the later event before the earlier one.
func TestPostgresConcurrentAddsKeepKeyOrder(t *testing.T) {
	ctx := context.Background()
	tb, pool := pgTable(t)
	cfg := pool.Config()
	app := fmt.Sprintf("outbox_second_%d", time.Now().UnixNano())
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	second, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()

	first, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Rollback(ctx)
	if err := tb.Add(ctx, first, outbox.Event{ID: "g", Subject: "s", OrderingKey: "K"}); err != nil {
		t.Fatal(err)
	}
	secondDone := make(chan error, 1)
	go func() {
		secondDone <- pgx.BeginFunc(ctx, second, func(tx pgx.Tx) error {
			return tb.Add(ctx, tx, outbox.Event{ID: "h", Subject: "s", OrderingKey: "K"})
		})
	}()
	// The second transaction has either committed (no key lock) or waits
	// for the first one's key lock.
	var finished bool
	testwait.Until(t, 0, "the second Add to commit or to wait for the key lock", func() bool {
		select {
		case err := <-secondDone:
			if err != nil {
				t.Fatalf("second transaction: %v", err)
			}
			finished = true
			return true
		default:
		}
		var waiting bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock' AND wait_event = 'advisory')`, app).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		return waiting
	})
	var published []string
	publish := func(_ context.Context, e outbox.Event) error { published = append(published, e.ID); return nil }
	if _, err := tb.Take(ctx, 10, publish); err != nil {
		t.Fatal(err)
	}
	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if !finished {
		if err := <-secondDone; err != nil {
			t.Fatalf("second transaction: %v", err)
		}
	}
	if _, err := tb.Take(ctx, 10, publish); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(published) != "[g h]" {
		t.Fatalf("published %v, want [g h]: the first-added event first", published)
	}
}

// Pending lists the table's migrations before Migrate, creating nothing,
// and none after it.
func TestPending(t *testing.T) {
	ctx := context.Background()
	t.Run("PostgreSQL", func(t *testing.T) {
		pool := pgtest.Pool(t)
		tb := pgoutbox.New(pool)
		if got, err := tb.Pending(ctx); err != nil || len(got) == 0 {
			t.Fatalf("before Migrate: %v, %v; want the table's migrations", got, err)
		}
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.tables WHERE table_schema = current_schema()`).Scan(&n); err != nil || n != 0 {
			t.Fatalf("Pending created %d tables (%v)", n, err)
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
		b.Run("postgres/"+name, func(b *testing.B) {
			tb, pool := pgTable(b)
			outboxtest.BenchTake(b, tb, keys, func(ctx context.Context, es []outbox.Event) error {
				return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					for _, e := range es {
						if err := tb.Add(ctx, tx, e); err != nil {
							return err
						}
					}
					return nil
				})
			})
		})
	}
}
