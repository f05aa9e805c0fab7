package pgstore_test

// Adversarial second reading of daeb376 (the handler's transaction begins
// with its first statement, the fenced completion goes with COMMIT, the
// claim inserts or reads in one statement): what happens to the pool's
// connection that a Tx now holds from Begin to its end.

import (
	"context"
	"errors"
	"strings"

	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/storetest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// connTracer holds a statement whose SQL contains leakMarker at its
// start (after the handler's pgx.Tx let it through, before it reaches the
// connection) until release is closed, as a scheduler may pause a
// goroutine there; and it records every Acquire that starts while
// armed and some connection of the pool is already acquired.
type connTracer struct {
	reached chan struct{} // closed when the marked statement is held
	release chan struct{} // close to let it go on

	armed     atomic.Bool
	heldTwice atomic.Int32 // acquires started while armed with a connection already out
}

const leakMarker = "adv_leak_marker"

func (a *connTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, leakMarker) {
		close(a.reached)
		<-a.release
	}
	return ctx
}

func (a *connTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (a *connTracer) TraceAcquireStart(ctx context.Context, pool *pgxpool.Pool, _ pgxpool.TraceAcquireStartData) context.Context {
	if a.armed.Load() && pool.Stat().AcquiredConns() > 0 {
		a.heldTwice.Add(1)
	}
	return ctx
}

func (a *connTracer) TraceAcquireEnd(context.Context, *pgxpool.Pool, pgxpool.TraceAcquireEndData) {}

// tracedPool is migratedPool with tr as the tracer and n connections.
func tracedPool(t *testing.T, tr *connTracer, n int32) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t, pgtest.MaxConns(n), func(c *pgxpool.Config) { c.ConnConfig.Tracer = tr })
	ctx := context.Background()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (name text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return pool
}

// TestLeakedStatementAfterCompleteNeverRunsOnReusedConn checks that a
// statement a leaked goroutine sends after Complete never runs on the
// connection the next request holds.
//
// It guards a bug found in the second reading of daeb376, as it was found:
// A goroutine the handler left behind passes the pgx.Tx's "ended?" check
// just before Complete, and sends its statement just after Complete gave
// the connection back to the pool: the check and the statement are not
// atomic (handlerTx.batch unlocks before tx.Exec), and Complete commits
// past pgx's dbTx, which stays open. The statement then runs on a
// connection that the next request holds, outside the first request's
// transaction, and commits on its own after the first request's answer:
// what the package documentation says the guard prevents. Allowed: the
// statement runs in the first request's transaction (before its
// Complete), or fails with pgx.ErrTxClosed.
func TestLeakedStatementAfterCompleteNeverRunsOnReusedConn(t *testing.T) {
	tr := &connTracer{reached: make(chan struct{}), release: make(chan struct{})}
	pool := tracedPool(t, tr, 1) // one connection: the next request gets the same one
	s := pgstore.New(pool, pgstore.Options{})
	ctx := context.Background()

	tx1, err := s.Begin(ctx, lease(t, s, params("u", "adv-leak-1", "fp")))
	if err != nil {
		t.Fatal(err)
	}
	ptx := tx1.(*pgstore.Tx).PgxTx()
	if _, err := ptx.Exec(ctx, `INSERT INTO effects (name) VALUES ('adv-handler')`); err != nil {
		t.Fatal(err)
	}
	leakErr := make(chan error, 1)
	go func() { // the handler's goroutine, still running when the answer goes out
		_, err := ptx.Exec(ctx, `INSERT INTO effects (name) VALUES ('adv-leaked') -- `+leakMarker)
		leakErr <- err
	}()
	<-tr.reached // it passed the pgx.Tx's check
	completed := make(chan error, 1)
	go func() { completed <- tx1.Complete(ctx, response("x")) }()
	select {
	case err := <-completed: // the connection is back in the pool
		if err != nil {
			t.Fatalf("Complete: %v", err)
		}
		// The next request takes the connection (the pool has one) and
		// writes and completes.
		tx2, err := s.Begin(ctx, lease(t, s, params("u", "adv-leak-2", "fp")))
		if err != nil {
			t.Fatal(err)
		}
		close(tr.release)
		err = <-leakErr
		t.Logf("leaked statement after Complete: %v", err)
		if _, err := tx2.(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO effects (name) VALUES ('adv-next')`); err != nil {
			t.Fatal(err)
		}
		if err := tx2.Complete(ctx, response("y")); err != nil {
			t.Fatal(err)
		}
	case <-time.After(2 * time.Second):
		// Complete waits for the statement in flight (not an assertion:
		// releasing it earlier or later changes nothing).
		close(tr.release)
		if err := <-leakErr; err != nil {
			t.Fatal(err)
		}
		if err := <-completed; err != nil {
			t.Fatalf("Complete: %v", err)
		}
	}
	// The leaked row, if any, committed in the first request's
	// transaction: the same xmin as the handler's row.
	var handlerXmin, leakedXmin string
	if err := pool.QueryRow(ctx, `SELECT xmin::text FROM effects WHERE name = 'adv-handler'`).Scan(&handlerXmin); err != nil {
		t.Fatal(err)
	}
	err = pool.QueryRow(ctx, `SELECT xmin::text FROM effects WHERE name = 'adv-leaked'`).Scan(&leakedXmin)
	if err == nil && leakedXmin != handlerXmin {
		t.Fatalf("a statement of the first request's pgx.Tx, sent after its Complete, committed in transaction %s, not in the request's (%s)", leakedXmin, handlerXmin)
	}
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		t.Fatal(err)
	}
}

// Under REPEATABLE READ, a Complete whose lease was taken over after the
// handler's snapshot fails with a serialization error, and aborted reads
// the key's owner through the pool while the Tx still holds its own
// connection (released only when Complete returns). Before daeb376 the
// transaction's connection went back to the pool at its rollback, before
// that read. Holding two connections at once deadlocks a pool whose
// every connection is held by such a Complete: the read waits forever
// (context.WithoutCancel).
func TestAbortedCompleteHoldsOneConnection(t *testing.T) {
	tr := &connTracer{}
	pool := tracedPool(t, tr, 2)
	clock := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	s := pgstore.New(pool, pgstore.Options{Now: clock.Now, TxOptions: pgx.TxOptions{IsoLevel: pgx.RepeatableRead}})
	// The other attempt's claim comes through a pool of its own.
	cfg := pool.Config()
	cfg.ConnConfig.Tracer = nil
	ctx := context.Background()
	other, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	s2 := pgstore.New(other, pgstore.Options{Now: clock.Now})

	p := params("u", "adv-rr-aborted", "fp")
	p.Lease = time.Second
	tx := begin(t, s, lease(t, s, p), "adv-rr") // the snapshot is taken here
	clock.Advance(2 * time.Second)
	if c, err := s2.Claim(ctx, p); err != nil || c.Lease == nil {
		t.Fatalf("takeover: %+v, %v", c, err)
	}
	tr.armed.Store(true)
	err = tx.Complete(ctx, response("x"))
	tr.armed.Store(false)
	if !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("Complete = %v, want ErrFenced", err)
	}
	if n := tr.heldTwice.Load(); n != 0 {
		t.Fatalf("Complete acquired %d more connection(s) while holding its own: a pool whose every connection is in such a Complete never gets one back", n)
	}
}
