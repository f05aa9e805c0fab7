package pgstore_test

// The handler's transaction begins with its first statement (BEGIN sent
// with it), the completion is sent with COMMIT, and the claim inserts or
// reads in one statement. These tests pin what that must not change.

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// keyRecord reads the key's response status (nil: none) and whether the
// row exists.
func keyRecord(t *testing.T, b *testBundle, user, key string) (exists bool, status *int) {
	t.Helper()
	err := b.pool.QueryRow(context.Background(),
		`SELECT response_status FROM idempotency_keys WHERE user_id = $1 AND key = $2`, user, key).Scan(&status)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return true, status
}

// Every way a handler can start its transaction (the statement sent with
// BEGIN, or BEGIN first) commits its writes with the completion, and the
// answer's round trip leaves nothing open.
func TestHandlerTxEveryFirstStatementCommitsWithCompletion(t *testing.T) {
	s, b := setup(t)
	ctx := context.Background()
	first := map[string]func(pgx.Tx, string) error{
		"exec": func(tx pgx.Tx, name string) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, name)
			return err
		},
		"queryrow": func(tx pgx.Tx, name string) error {
			var got string
			return tx.QueryRow(ctx, `INSERT INTO effects (name) VALUES ($1) RETURNING name`, name).Scan(&got)
		},
		"query": func(tx pgx.Tx, name string) error {
			rows, err := tx.Query(ctx, `INSERT INTO effects (name) VALUES ($1) RETURNING name`, name)
			if err != nil {
				return err
			}
			n := 0
			for rows.Next() {
				n++
			}
			rows.Close()
			if n != 1 {
				return errors.New("query returned no row")
			}
			return rows.Err()
		},
		"batch": func(tx pgx.Tx, name string) error {
			bt := &pgx.Batch{}
			bt.Queue(`INSERT INTO effects (name) VALUES ($1)`, name)
			return tx.SendBatch(ctx, bt).Close()
		},
		"copy": func(tx pgx.Tx, name string) error {
			_, err := tx.CopyFrom(ctx, pgx.Identifier{"effects"}, []string{"name"}, pgx.CopyFromRows([][]any{{name}}))
			return err
		},
		"savepoint": func(tx pgx.Tx, name string) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := sp.Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, name); err != nil {
				return err
			}
			return sp.Commit(ctx)
		},
	}
	for name, run := range first {
		t.Run(name, func(t *testing.T) {
			l := lease(t, s, params("u", "htx-"+name, "fp"))
			tx, err := s.Begin(ctx, l)
			if err != nil {
				t.Fatal(err)
			}
			ptx := tx.(*pgstore.Tx).PgxTx()
			if err := run(ptx, name); err != nil {
				t.Fatalf("first statement: %v", err)
			}
			// A second statement runs in the same transaction.
			if _, err := ptx.Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, name+"/2"); err != nil {
				t.Fatal(err)
			}
			if n := effects(t, b, name); n != 0 {
				t.Fatalf("%d effects visible before Complete, want 0 (not in a transaction?)", n)
			}
			if err := tx.Complete(ctx, response(name)); err != nil {
				t.Fatalf("Complete: %v", err)
			}
			if n, n2 := effects(t, b, name), effects(t, b, name+"/2"); n != 1 || n2 != 1 {
				t.Fatalf("effects after Complete: %d and %d, want 1 and 1", n, n2)
			}
			if _, st := keyRecord(t, b, "u", "htx-"+name); st == nil || *st != 201 {
				t.Fatalf("stored status %v, want 201", st)
			}
		})
	}
}

// A handler that ran no statement: the completion runs alone and stores
// the answer; fenced, it stores nothing and says so.
func TestHandlerTxCompleteWithoutStatement(t *testing.T) {
	s, b := setup(t)
	ctx := context.Background()
	l := lease(t, s, params("u", "nostmt", "fp"))
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, response("x")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if _, st := keyRecord(t, b, "u", "nostmt"); st == nil || *st != 201 {
		t.Fatalf("stored status %v, want 201", st)
	}

	// Taken over before Complete.
	p := params("u", "nostmt-fenced", "fp")
	p.Lease = time.Second
	l = lease(t, s, p)
	tx, err = s.Begin(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	b.clock.Advance(2 * time.Second)
	if c, err := s.Claim(ctx, p); err != nil || c.Lease == nil {
		t.Fatalf("takeover: %+v, %v", c, err)
	}
	if err := tx.Complete(ctx, response("x")); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("fenced Complete = %v, want ErrFenced", err)
	}
	if _, st := keyRecord(t, b, "u", "nostmt-fenced"); st != nil {
		t.Fatalf("fenced completion stored status %d", *st)
	}
	// Complete(nil) (release) fenced the same way.
	p = params("u", "nostmt-release", "fp")
	p.Lease = time.Second
	l = lease(t, s, p)
	tx, _ = s.Begin(ctx, l)
	b.clock.Advance(2 * time.Second)
	if c, err := s.Claim(ctx, p); err != nil || c.Lease == nil {
		t.Fatalf("takeover: %+v, %v", c, err)
	}
	if err := tx.Complete(ctx, nil); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("fenced release = %v, want ErrFenced", err)
	}
	if exists, _ := keyRecord(t, b, "u", "nostmt-release"); !exists {
		t.Fatal("a fenced release deleted the other attempt's record")
	}
}

// Fenced after the handler wrote: the COMMIT sent with the completion is
// not carried out, the handler's write is rolled back, and the pool's
// connection is usable again (no transaction left on it).
func TestHandlerTxFencedBatchCommitsNothing(t *testing.T) {
	s, b := setup(t)
	ctx := context.Background()
	p := params("u", "fenced-batch", "fp")
	p.Lease = time.Second
	l := lease(t, s, p)
	tx := begin(t, s, l, "fenced-write")
	b.clock.Advance(2 * time.Second)
	if c, err := s.Claim(ctx, p); err != nil || c.Lease == nil {
		t.Fatalf("takeover: %+v, %v", c, err)
	}
	err := tx.Complete(ctx, response("x"))
	if !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("Complete = %v, want ErrFenced", err)
	}
	if n := effects(t, b, "fenced-write"); n != 0 {
		t.Fatalf("a fenced attempt's write committed (%d rows)", n)
	}
	if _, st := keyRecord(t, b, "u", "fenced-batch"); st != nil {
		t.Fatalf("a fenced attempt stored status %d", *st)
	}
	// Every connection of the pool is outside a transaction.
	for _, c := range b.pool.AcquireAllIdle(ctx) {
		if st := c.Conn().PgConn().TxStatus(); st != 'I' {
			t.Errorf("a pooled connection's transaction status is %q, want 'I'", st)
		}
		c.Release()
	}
}

// A handler's failing first statement: the transaction is aborted, the
// completion fails, nothing commits, and the failure is not ErrFenced.
func TestHandlerTxFailingFirstStatement(t *testing.T) {
	s, b := setup(t)
	ctx := context.Background()
	for _, bad := range []string{
		`INSERT INTO effects (name) VALUES (NULL)`, // a constraint: the statement runs and fails
		`INSERT INTO no_such_table VALUES (1)`,     // refused when it is prepared
	} {
		key := "bad-" + bad[len(bad)-6:]
		l := lease(t, s, params("u", key, "fp"))
		tx, err := s.Begin(ctx, l)
		if err != nil {
			t.Fatal(err)
		}
		ptx := tx.(*pgstore.Tx).PgxTx()
		if _, err := ptx.Exec(ctx, bad); err == nil {
			t.Fatalf("%s succeeded", bad)
		}
		// What the handler does next fails as well, or is refused.
		if _, err := ptx.Exec(ctx, `INSERT INTO effects (name) VALUES ('after-bad')`); err == nil {
			// A statement refused when prepared never began the
			// transaction; one that ran left it aborted. Either way a
			// later write must not commit on its own.
			t.Logf("%s: the next statement ran", bad)
		}
		err = tx.Complete(ctx, response("x"))
		if err == nil {
			t.Fatalf("%s: Complete succeeded after a failed statement", bad)
		}
		if errors.Is(err, idem.ErrFenced) {
			t.Fatalf("%s: Complete = %v: not fenced, the lease is this attempt's", bad, err)
		}
		if n := effects(t, b, "after-bad"); n != 0 {
			t.Fatalf("%s: a write after the failed statement committed", bad)
		}
		if _, st := keyRecord(t, b, "u", key); st != nil {
			t.Fatalf("%s: stored status %d after a failed transaction", bad, *st)
		}
	}
}

// The handler's pgx.Tx refuses everything once the Tx ended, so that a
// goroutine left behind cannot run statements on a connection that went
// back to the pool.
func TestHandlerTxRefusedAfterEnd(t *testing.T) {
	s, _ := setup(t)
	ctx := context.Background()
	for _, end := range []string{"complete", "rollback", "complete-nostmt", "rollback-nostmt"} {
		l := lease(t, s, params("u", "ended-"+end, "fp"))
		tx, err := s.Begin(ctx, l)
		if err != nil {
			t.Fatal(err)
		}
		ptx := tx.(*pgstore.Tx).PgxTx()
		sp := pgx.Tx(nil)
		if end == "complete" || end == "rollback" {
			if _, err := ptx.Exec(ctx, `INSERT INTO effects (name) VALUES ('x')`); err != nil {
				t.Fatal(err)
			}
			if sp, err = ptx.Begin(ctx); err != nil {
				t.Fatal(err)
			}
			if err := sp.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if sp, err = ptx.Begin(ctx); err != nil {
				t.Fatal(err)
			}
		}
		if end == "complete" || end == "complete-nostmt" {
			if err := tx.Complete(ctx, response("x")); err != nil {
				t.Fatal(err)
			}
		} else if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		var v int
		if _, err := ptx.Exec(ctx, `SELECT 1`); !errors.Is(err, pgx.ErrTxClosed) {
			t.Errorf("%s: Exec = %v, want ErrTxClosed", end, err)
		}
		if err := ptx.QueryRow(ctx, `SELECT 1`).Scan(&v); !errors.Is(err, pgx.ErrTxClosed) {
			t.Errorf("%s: QueryRow = %v, want ErrTxClosed", end, err)
		}
		if rows, err := ptx.Query(ctx, `SELECT 1`); !errors.Is(err, pgx.ErrTxClosed) || rows.Next() {
			t.Errorf("%s: Query = %v, want ErrTxClosed", end, err)
		}
		if err := ptx.SendBatch(ctx, &pgx.Batch{}).Close(); !errors.Is(err, pgx.ErrTxClosed) {
			t.Errorf("%s: SendBatch = %v, want ErrTxClosed", end, err)
		}
		if _, err := ptx.Begin(ctx); !errors.Is(err, pgx.ErrTxClosed) {
			t.Errorf("%s: Begin = %v, want ErrTxClosed", end, err)
		}
		if c := ptx.Conn(); c != nil {
			t.Errorf("%s: Conn() = %p, want nil after the end", end, c)
		}
		if sp != nil {
			if _, err := sp.Exec(ctx, `SELECT 1`); !errors.Is(err, pgx.ErrTxClosed) {
				t.Errorf("%s: savepoint Exec = %v, want ErrTxClosed", end, err)
			}
		}
	}
}

// A claim whose INSERT conflicts with a row committed while it waited
// (not visible to the statement's snapshot) reads it again and decides:
// here, the other claim's live lease is a 409, never an error or a second
// lease.
func TestClaimSeesRowCommittedWhileWaiting(t *testing.T) {
	s, b := setup(t)
	ctx := context.Background()
	p := params("u", "waited", "fp")
	// Another claim, held open: the row is inserted, not committed.
	other, err := b.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback(ctx)
	if _, err := other.Exec(ctx, `
INSERT INTO idempotency_keys (user_id, key, fingerprint, method, path, owner, lease_until, attempts, created_at, expires_at)
VALUES ('u', 'waited', 'fp', 'POST', '/v1/orders', 'other-owner', $1::timestamptz + interval '30 seconds', 1, $1, $1::timestamptz + interval '1 day')`,
		b.clock.Now()); err != nil {
		t.Fatal(err)
	}
	claimed := claimWaiting(t, b.pool, s, p, "the claim to wait on the uncommitted row",
		`(query LIKE '%ON CONFLICT%' OR query LIKE '%idem_claim(%')`)
	if err := other.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	c, cer := claimed()
	var inflight *idem.InFlightError
	if !errors.As(cer, &inflight) {
		t.Fatalf("Claim = %+v, %v; want an InFlightError (the other claim's lease)", c, cer)
	}
	if c.Lease != nil {
		t.Fatalf("a second lease on a key another claim holds: %+v", c.Lease)
	}
}

// The fenced completion's error is recognised only by its own marker: a
// handler's own invalid integer is not ErrFenced.
func TestHandlerCastErrorIsNotFenced(t *testing.T) {
	s, b := setup(t)
	ctx := context.Background()
	l := lease(t, s, params("u", "cast", "fp"))
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	_, err = tx.(*pgstore.Tx).PgxTx().Exec(ctx, `SELECT 'idem: fenced'::int`)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "22P02" {
		t.Fatalf("cast error = %v", err)
	}
	err = tx.Complete(ctx, response("x"))
	if err == nil || errors.Is(err, idem.ErrFenced) {
		t.Fatalf("Complete after the handler's own cast error = %v, want an error that is not ErrFenced", err)
	}
	if _, st := keyRecord(t, b, "u", "cast"); st != nil {
		t.Fatalf("stored status %d", *st)
	}
}

// The handler's Commit and Rollback are refused (idem.ErrTxOwned) before
// its first statement and after it, and change nothing; its savepoints
// (Begin, pgx.BeginFunc) still commit and roll back. Everything the
// handler kept commits with the completion, and nothing before it.
func TestHandlerCannotEndTxButSavepointsCan(t *testing.T) {
	s, b := setup(t)
	ctx := context.Background()
	const key = "htx-owned"
	l := lease(t, s, params("u", key, "fp"))
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	ptx := tx.(*pgstore.Tx).PgxTx()
	refused := func(when string) {
		t.Helper()
		if err := ptx.Commit(ctx); !errors.Is(err, idem.ErrTxOwned) {
			t.Fatalf("Commit %s = %v, want idem.ErrTxOwned", when, err)
		}
		if err := ptx.Rollback(ctx); !errors.Is(err, idem.ErrTxOwned) {
			t.Fatalf("Rollback %s = %v, want idem.ErrTxOwned", when, err)
		}
	}
	insert := func(tx pgx.Tx, name string) {
		t.Helper()
		if _, err := tx.Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, name); err != nil {
			t.Fatalf("insert %s: %v", name, err)
		}
	}
	refused("before any statement")
	insert(ptx, "htx-owned-kept")
	refused("after a write")

	sp, err := ptx.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	insert(sp, "htx-owned-undone")
	if err := sp.Rollback(ctx); err != nil {
		t.Fatalf("a savepoint's Rollback: %v", err)
	}
	sp, err = ptx.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	insert(sp, "htx-owned-released")
	if err := sp.Commit(ctx); err != nil {
		t.Fatalf("a savepoint's Commit: %v", err)
	}
	if err := pgx.BeginFunc(ctx, ptx, func(sp pgx.Tx) error {
		insert(sp, "htx-owned-beginfunc")
		return nil
	}); err != nil {
		t.Fatalf("pgx.BeginFunc on the handler's transaction: %v", err)
	}
	refused("after savepoints")

	if n := effects(t, b, "htx-owned-kept"); n != 0 {
		t.Fatalf("the handler's write is visible before Complete (%d rows): its transaction ended", n)
	}
	if err := tx.Complete(ctx, response("owned")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	for name, want := range map[string]int{
		"htx-owned-kept": 1, "htx-owned-undone": 0, "htx-owned-released": 1, "htx-owned-beginfunc": 1,
	} {
		if n := effects(t, b, name); n != want {
			t.Errorf("%s: %d rows, want %d", name, n, want)
		}
	}
	if _, st := keyRecord(t, b, "u", key); st == nil || *st != 201 {
		t.Fatalf("stored status %v, want 201", st)
	}
}
