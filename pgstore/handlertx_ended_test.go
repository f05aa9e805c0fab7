package pgstore_test

import (
	"context"
	"testing"

	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5"
)

// FINDING (adversarial review): a large-object handle (LargeObjects) or a
// savepoint's connection (Conn) that the handler took before the request
// ended still reaches the pool's connection after Complete gave it back:
// Complete commits past pgx's own transaction object, which stays open,
// and pgx.LargeObjects and a savepoint's Conn go straight to it. A
// goroutine the handler left running then creates a large object in
// autocommit, outside any request (or inside the next request that holds
// the connection). Every handle the handler got must fail once the Tx
// ended, as its Exec, Query and Conn do (TestHandlerTxRefusedAfterEnd).
func TestHandlerTxLargeObjectsAndSavepointConnRefusedAfterEnd(t *testing.T) {
	s, b := setup(t)
	ctx := context.Background()
	for _, end := range []string{"complete", "rollback"} {
		t.Run(end, func(t *testing.T) {
			l := lease(t, s, params("u", "lo-ended-"+end, "fp"))
			tx, err := s.Begin(ctx, l)
			if err != nil {
				t.Fatal(err)
			}
			ptx := tx.(*pgstore.Tx).PgxTx()
			lo := ptx.LargeObjects() // begins the transaction
			sp, err := ptx.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			spLO := sp.LargeObjects()
			if end == "complete" {
				err = tx.Complete(ctx, response("x"))
			} else {
				err = tx.Rollback(ctx)
			}
			if err != nil {
				t.Fatalf("%s: %v", end, err)
			}

			var created []uint32
			for name, lo := range map[string]pgx.LargeObjects{"the handler's": lo, "a savepoint's": spLO} {
				oid, err := lo.Create(ctx, 0)
				if err == nil {
					created = append(created, oid)
					t.Errorf("%s LargeObjects().Create after %s = oid %d, nil; want an error (pgx.ErrTxClosed)", name, end, oid)
				}
			}
			if c := sp.Conn(); c != nil {
				t.Errorf("a savepoint's Conn() after %s = %p, want nil (the connection is back in the pool)", end, c)
			}
			for _, oid := range created {
				var n int
				if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM pg_largeobject_metadata WHERE oid = $1`, oid).Scan(&n); err != nil {
					t.Fatal(err)
				}
				if n != 0 {
					t.Errorf("large object %d committed on its own, after the request's transaction ended", oid)
				}
				if _, err := b.pool.Exec(ctx, `SELECT lo_unlink($1)`, oid); err != nil {
					t.Errorf("unlinking large object %d: %v", oid, err)
				}
			}
		})
	}
}
