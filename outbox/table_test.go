package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/outbox"
)

// TestSQLiteMigrateConcurrent: processes that start at once (each its own
// pool on one file) all migrate without error, and again later.
func TestSQLiteMigrateConcurrent(t *testing.T) {
	path := t.TempDir() + "/m.db"
	var dbs []*sql.DB
	for range 4 {
		dbs = append(dbs, openSQLite(t, path))
	}
	migrateAll(t, func(i int) error { return outbox.NewSQLite(dbs[i]).Migrate(context.Background()) }, len(dbs))
	var n int
	if err := dbs[0].QueryRow(`SELECT count(*) FROM schema_migrations WHERE component = ?`, outbox.Component).Scan(&n); err != nil || n != 1 {
		t.Fatalf("outbox versions recorded: %d, %v; want 1", n, err)
	}
}

// TestPostgresMigrateConcurrent: instances that start at once (each its
// own pool on one schema) all migrate without error, and again later.
func TestPostgresMigrateConcurrent(t *testing.T) {
	_, pool := pgTableUnmigrated(t)
	pools := []*pgxpool.Pool{pool}
	for len(pools) < 4 {
		pools = append(pools, samePool(t, pool))
	}
	migrateAll(t, func(i int) error { return outbox.NewPostgres(pools[i]).Migrate(context.Background()) }, len(pools))
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM schema_migrations WHERE component = $1`, outbox.Component).Scan(&n); err != nil || n != 1 {
		t.Fatalf("outbox versions recorded: %d, %v; want 1", n, err)
	}
}

// migrateAll runs migrate(0..n-1) at once, then each again, failing t on
// any error.
func migrateAll(t *testing.T, migrate func(i int) error, n int) {
	t.Helper()
	for round := range 2 {
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() { errs[i] = migrate(i) })
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Errorf("round %d, instance %d: Migrate: %v", round, i, err)
			}
		}
	}
}

func pgTableUnmigrated(t *testing.T) (*outbox.Postgres, *pgxpool.Pool) {
	t.Helper()
	pool := pgtest.Pool(t)
	return outbox.NewPostgres(pool), pool
}

// slowBroker checks that a broker that does not answer holds a Take's
// locks for PublishTimeout only: the publish's ctx ends, the event stays
// unsent with one attempt counted, the events after it are left for the
// next pass (not attempted), and the next pass publishes them in order.
func slowBroker(t *testing.T, tb outbox.Table, add func(...outbox.Event), attempts func(id string) int) {
	t.Helper()
	ctx := context.Background()
	add(outbox.Event{ID: "slow-1", Subject: "s", OrderingKey: "a"}, outbox.Event{ID: "other-1", Subject: "s", OrderingKey: "b"})
	n, err := tb.Take(ctx, 10, func(ctx context.Context, e outbox.Event) error {
		<-ctx.Done() // the broker never answers
		return ctx.Err()
	})
	if n != 0 || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Take with a broker that does not answer = %d, %v; want 0 and DeadlineExceeded", n, err)
	}
	if got := attempts("slow-1"); got != 1 {
		t.Errorf("slow-1: %d attempts, want 1", got)
	}
	if got := attempts("other-1"); got != 0 {
		t.Errorf("other-1: %d attempts, want 0 (left for the next pass)", got)
	}
	var got []string
	n, err = tb.Take(ctx, 10, func(_ context.Context, e outbox.Event) error { got = append(got, e.ID); return nil })
	if n != 2 || err != nil || fmt.Sprint(got) != "[slow-1 other-1]" {
		t.Fatalf("next Take = %d, %v, published %v; want 2, nil, [slow-1 other-1]", n, err, got)
	}
}

func TestSQLiteSlowBroker(t *testing.T) {
	tb, db, _ := sqliteTable(t)
	tb.PublishTimeout = 50 * time.Millisecond
	slowBroker(t, tb, func(es ...outbox.Event) {
		tx, err := db.Begin()
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
	}, func(id string) int {
		var n int
		if err := db.QueryRow(`SELECT attempts FROM idem_outbox WHERE id = ?`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	})
}

func TestPostgresSlowBroker(t *testing.T) {
	tb, pool := pgTable(t)
	tb.PublishTimeout = 50 * time.Millisecond
	ctx := context.Background()
	slowBroker(t, tb, func(es ...outbox.Event) {
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

// TestSQLiteTakeWaitsForWriter: a Take that finds the database's write
// lock held (a request's transaction, begun IMMEDIATE as sqlitestore
// does) waits for it under busy_timeout, and then publishes what that
// transaction committed.
func TestSQLiteTakeWaitsForWriter(t *testing.T) {
	ctx := context.Background()
	tb, db, _ := sqliteTable(t)
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
	if r.n != 1 || r.err != nil || fmt.Sprint(r.ids) != "[w1]" {
		t.Fatalf("Take after the writer committed = %+v; want 1 event, w1", r)
	}
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
	relayTable := outbox.NewPostgres(relayPool)
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return tb.Add(ctx, tx, outbox.Event{ID: "lost-1", Subject: "s", OrderingKey: "k"})
	}); err != nil {
		t.Fatal(err)
	}
	var published []string
	n, err := relayTable.Take(ctx, 10, func(_ context.Context, e outbox.Event) error {
		published = append(published, e.ID)
		var killed int
		err := pool.QueryRow(ctx, `
			SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
			WHERE application_name = $1 AND state = 'idle in transaction'`, app).Scan(&killed)
		if err != nil || killed != 1 {
			return fmt.Errorf("terminating the relay's connection: %d, %w", killed, err)
		}
		return nil // the broker has it
	})
	if n != 0 || err == nil {
		t.Fatalf("Take whose connection died = %d, %v; want 0 and an error", n, err)
	}
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
