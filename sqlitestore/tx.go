package sqlitestore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

// Tx is the transaction in which a handler writes and its outcome is
// committed. Handlers write through SQL (or reach it with FromContext),
// whose Commit and Rollback refuse; the middleware calls Complete or
// Rollback.
type Tx struct {
	s     *Store
	lease *idemdriver.Lease
	tx    *sql.Tx
	h     HandlerTx // tx, as SQL and FromContext hand it out

	mu     sync.Mutex // guards done and the end of tx
	done   bool       // Complete or Rollback was called
	unlock func()     // lets the store's next writer go; called when tx ends
}

// SQL returns the database transaction, for the handler's writes. Its
// Commit and Rollback refuse with an error matching idem.ErrTxOwned: the
// middleware commits it with the stored answer (Complete), or rolls it
// back.
func (t *Tx) SQL() *HandlerTx { return &t.h }

// FromContext returns the database transaction of the claimed request that
// ctx belongs to, beginning it on first use (see idem.TxFromContext); a
// wrapper's transaction (see idemdriver.UnwrapTx) is unwrapped. Its Commit and
// Rollback refuse (see HandlerTx). It returns idem.ErrNoTx outside a
// claimed request, idem.ErrSettled after it was answered, and
// idem.ErrForeignTx when the request's store is not a sqlitestore.
func FromContext(ctx context.Context) (*HandlerTx, error) {
	tx, err := idem.TxFromContext(ctx)
	if err != nil {
		return nil, err
	}
	inner := idemdriver.UnwrapTx(tx)
	stx, ok := inner.(*Tx)
	if !ok {
		return nil, fmt.Errorf("%w: %T", idem.ErrForeignTx, inner)
	}
	return &stx.h, nil
}

// Complete implements idem.Tx. With resp non-nil it stores the response,
// and a record whose expiry passed while its attempt ran is kept for its
// TTL again from now (expires_at = now + (expires_at - created_at)), so
// that the client's retry finds the answer instead of starting a new
// operation; with resp nil it deletes the record; either only while the lease is
// still the caller's and the key not completed, else it rolls back and
// returns idem.ErrFenced. Then it commits. A second call, or a call after
// Rollback, returns idem.ErrFenced.
func (t *Tx) Complete(ctx context.Context, resp *idemdriver.Response) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return idem.ErrFenced
	}
	t.done = true
	defer t.unlock()
	var (
		res sql.Result
		err error
	)
	if resp == nil {
		res, err = t.tx.ExecContext(ctx, `
			DELETE FROM idempotency_keys
			WHERE user_id = ? AND key = ? AND owner = ? AND response_status IS NULL`,
			t.lease.User, t.lease.Key, t.lease.Owner)
	} else {
		var header string
		if header, err = encodeHeader(resp.Header); err != nil {
			t.tx.Rollback()
			return err
		}
		var trailer sql.NullString // NULL without trailers
		if len(resp.Trailer) > 0 {
			trailer.Valid = true
			if trailer.String, err = encodeHeader(resp.Trailer); err != nil {
				t.tx.Rollback()
				return err
			}
		}
		now := toNanos(t.s.now())
		res, err = t.tx.ExecContext(ctx, `
			UPDATE idempotency_keys
			SET response_status = ?, response_header = ?, response_body = ?, response_trailer = ?, completed_at = ?,
				request_body = NULL,
				expires_at = CASE WHEN expires_at <= ? THEN ? + (expires_at - created_at) ELSE expires_at END
			WHERE user_id = ? AND key = ? AND owner = ? AND response_status IS NULL`,
			resp.Status, header, resp.Body, trailer, now, now, now,
			t.lease.User, t.lease.Key, t.lease.Owner)
	}
	if err := fenced("complete", res, err); err != nil {
		t.tx.Rollback()
		return err
	}
	if err := t.tx.Commit(); err != nil {
		return interpretError("commit", err)
	}
	return nil
}

// Rollback implements idem.Tx. It is a no-op after Complete or another
// Rollback.
func (t *Tx) Rollback(ctx context.Context) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return nil
	}
	t.done = true
	defer t.unlock()
	if err := t.tx.Rollback(); err != nil && !errors.Is(err, sql.ErrTxDone) {
		return interpretError("rollback", err)
	}
	return nil
}
