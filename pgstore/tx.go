package pgstore

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/idem-go/idem"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Tx is the transaction in which a handler writes and in which its outcome
// commits. Handlers reach it with FromContext (or PgxTx); the middleware
// calls Complete or Rollback.
type Tx struct {
	s     *Store
	lease *idem.Lease
	tx    pgx.Tx

	mu   sync.Mutex // guards done
	done bool       // Complete or Rollback was called
}

// Begin implements idem.Store: it opens a database transaction with
// Options.TxOptions. It does not touch the key's row, so the transaction
// holds no lock that a Claim could wait on until Complete.
func (s *Store) Begin(ctx context.Context, l *idem.Lease) (idem.Tx, error) {
	tx, err := s.pool.BeginTx(ctx, s.txOptions)
	if err != nil {
		return nil, interpretError(err)
	}
	return &Tx{s: s, lease: l, tx: tx}, nil
}

// PgxTx returns the database transaction, for the handler's writes. The
// handler must not commit or roll it back.
func (tx *Tx) PgxTx() pgx.Tx { return tx.tx }

// FromContext returns the database transaction of the claimed request that
// ctx belongs to, beginning it on first use; a wrapper's transaction (see
// idem.UnwrapTx) is unwrapped. Outside a claimed request it returns
// idem.ErrNoTx; after the request was answered, idem.ErrSettled; when
// the request's store is not a pgstore.Store, idem.ErrForeignTx.
func FromContext(ctx context.Context) (pgx.Tx, error) {
	tx, err := idem.TxFromContext(ctx)
	if err != nil {
		return nil, err
	}
	ptx, ok := idem.UnwrapTx(tx).(*Tx)
	if !ok {
		return nil, fmt.Errorf("%w: %T", idem.ErrForeignTx, tx)
	}
	return ptx.tx, nil
}

// Complete implements idem.Tx. The fenced UPDATE (or, with resp nil,
// DELETE) of the key's row is the transaction's last statement before
// COMMIT, so the row stays locked only for the commit itself. The
// completion's time is the database's statement_timestamp() (see Clocks in
// the package documentation). A record whose expiry passed while its
// attempt ran is kept for its TTL again from the completion
// (expires_at = now + (expires_at - created_at), counted in microseconds,
// so that a day is 24 hours in every time zone), so the client's retry
// replays the answer instead of starting a new operation. If the lease
// was taken over the statement matches no row: Complete rolls back and
// returns idem.ErrFenced. A second Complete, or one after Rollback, returns
// idem.ErrFenced too.
func (tx *Tx) Complete(ctx context.Context, resp *idem.Response) error {
	tx.mu.Lock()
	defer tx.mu.Unlock()
	if tx.done {
		return idem.ErrFenced
	}
	tx.done = true
	l := tx.lease
	var (
		tag pgconn.CommandTag
		err error
	)
	if resp == nil {
		tag, err = tx.tx.Exec(ctx, `
DELETE FROM idempotency_keys
WHERE user_id = $1 AND key = $2 AND owner = $3 AND response_status IS NULL`,
			l.User, l.Key, l.Owner)
	} else {
		var header, trailer []byte // trailer NULL without trailers
		header, err = marshalHeader(resp.Header)
		if err == nil && len(resp.Trailer) > 0 {
			trailer, err = marshalHeader(resp.Trailer)
		}
		if err == nil {
			tag, err = tx.tx.Exec(ctx, `
UPDATE idempotency_keys
SET response_status = $4, response_header = $5, response_body = $6, response_trailer = $8, completed_at = c.now,
	expires_at = CASE WHEN expires_at > c.now THEN expires_at
		ELSE c.now + interval '1 microsecond' * (extract(epoch FROM expires_at - created_at) * 1000000) END
FROM (SELECT coalesce($7::timestamptz, statement_timestamp()) AS now) c
WHERE user_id = $1 AND key = $2 AND owner = $3 AND response_status IS NULL`,
				l.User, l.Key, l.Owner, resp.Status, header, resp.Body, tx.s.at(), trailer)
		}
	}
	if err != nil {
		tx.tx.Rollback(context.WithoutCancel(ctx))
		return tx.aborted(ctx, err)
	}
	if tag.RowsAffected() == 0 {
		if err := tx.tx.Rollback(context.WithoutCancel(ctx)); err != nil {
			return errors.Join(idem.ErrFenced, interpretError(err))
		}
		return idem.ErrFenced
	}
	if err := tx.tx.Commit(ctx); err != nil {
		return tx.aborted(ctx, err)
	}
	return nil
}

// aborted is Complete's error when the completion or its COMMIT failed.
// With the database's default isolation at REPEATABLE READ or
// SERIALIZABLE, the fenced UPDATE of a row that another claim took over
// after the transaction's snapshot raises a serialization failure instead
// of matching no row, and SERIALIZABLE may refuse the COMMIT for the same
// reason. Both rolled everything back; the key's row, read again in a
// statement of its own, tells which case it was: owned by another attempt
// (or gone) is idem.ErrFenced, as under READ COMMITTED; still this
// attempt's, the error is returned as it is, and the middleware fails the
// attempt. Any other error is returned as it is: a COMMIT whose answer
// was lost may have committed, and only the record can say.
func (tx *Tx) aborted(ctx context.Context, err error) error {
	if !lostRace(err) {
		return interpretError(err)
	}
	l := tx.lease
	var owner string
	switch qerr := tx.s.pool.QueryRow(context.WithoutCancel(ctx),
		`SELECT owner FROM idempotency_keys WHERE user_id = $1 AND key = $2`, l.User, l.Key).Scan(&owner); {
	case errors.Is(qerr, pgx.ErrNoRows), qerr == nil && owner != l.Owner:
		return fmt.Errorf("%w (%w)", idem.ErrFenced, interpretError(err))
	}
	return interpretError(err)
}

// Rollback implements idem.Tx. It is a no-op after Complete or a first
// Rollback.
func (tx *Tx) Rollback(ctx context.Context) error {
	tx.mu.Lock()
	defer tx.mu.Unlock()
	if tx.done {
		return nil
	}
	tx.done = true
	if err := tx.tx.Rollback(context.WithoutCancel(ctx)); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return interpretError(err)
	}
	return nil
}
