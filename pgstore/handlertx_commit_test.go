package pgstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idem-go/idem"

	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5"
)

// A handler that ends the transaction itself, against PgxTx's doc
// (COMMIT / ROLLBACK sent as statements: its Commit and Rollback methods
// are refused, see TestHandlerCannotEndTxButSavepointsCan), or leaves
// Rows open: Complete must not report success, and must not store an
// answer for work that is not in the same transaction.
func TestHandlerEndingTransactionItselfStoresNoAnswer(t *testing.T) {
	s, b := setup(t)
	ctx := context.Background()
	cases := map[string]func(pgx.Tx) error{
		"rollback-statement": func(ptx pgx.Tx) error {
			_, err := ptx.Exec(ctx, `ROLLBACK`)
			return err
		},
		"commit-statement": func(ptx pgx.Tx) error {
			_, err := ptx.Exec(ctx, `COMMIT`)
			return err
		},
		"open-rows": func(ptx pgx.Tx) error {
			_, err := ptx.Query(ctx, `SELECT generate_series(1, 10)`) //nolint:sqlclosecheck // the tx ends with its rows open, on purpose
			return err
		},
	}
	for name, end := range cases {
		t.Run(name, func(t *testing.T) {
			key := "adv-end-" + name
			tx := begin(t, s, lease(t, s, params("u", key, "fp")), "adv-before-"+name)
			ptx := tx.(*pgstore.Tx).PgxTx()
			if err := end(ptx); err != nil {
				t.Fatalf("ending: %v", err)
			}
			err := tx.Complete(ctx, response("x"))
			_, st := keyRecord(t, b, "u", key)
			before := effects(t, b, "adv-before-"+name)
			t.Logf("%s: Complete = %v; stored %v; handler's write committed %d", name, err, st != nil, before)
			if err == nil && before == 0 {
				t.Fatalf("%s: Complete succeeded and stored the answer, but the handler's write is gone", name)
			}
		})
	}
}

// The connection is terminated while the completion, sent with COMMIT,
// waits for the key's row: Complete returns an error that is neither
// success nor ErrFenced, and nothing of the attempt committed.
func TestTerminatedDuringCompletionCommitsNothing(t *testing.T) {
	s, b := setup(t)
	ctx := context.Background()
	key := "adv-terminated"
	l := lease(t, s, params("u", key, "fp"))
	tx := begin(t, s, l, "adv-terminated")
	pid := tx.(*pgstore.Tx).PgxTx().Conn().PgConn().PID()
	locker, err := b.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Rollback(ctx)
	if _, err := locker.Exec(ctx, `SELECT 1 FROM idempotency_keys WHERE user_id = 'u' AND key = $1 FOR UPDATE`, key); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- tx.Complete(ctx, response("x")) }()
	testwait.Until(t, 10*time.Second, "the completion to wait for the row lock", func() bool {
		var waiting bool
		if err := b.pool.QueryRow(ctx, `SELECT wait_event_type IS NOT DISTINCT FROM 'Lock' FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		return waiting
	})
	if _, err := b.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	err = <-done
	if err := locker.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err == nil || errors.Is(err, idem.ErrFenced) {
		t.Fatalf("Complete on a terminated connection = %v, want an error that is not ErrFenced", err)
	}
	if _, st := keyRecord(t, b, "u", key); st != nil {
		t.Fatalf("stored %d", *st)
	}
	if n := effects(t, b, "adv-terminated"); n != 0 {
		t.Fatalf("the write committed")
	}
	if err := s.Fail(ctx, l); err != nil {
		t.Logf("Fail after: %v", err)
	}
}
