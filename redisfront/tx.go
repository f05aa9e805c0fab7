package redisfront

import (
	"context"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

// Tx is the transaction Begin returns: the inner store's, which Unwrap
// returns, and which it completes before caching the response in Redis and
// dropping the lease lock.
//
// A handler reaches its transaction through its store's accessor
// (pgstore.FromContext and the like), which type-asserts what
// idem.TxFromContext returns. Those accessors must unwrap a Tx first, by
// following Unwrap() idem.Tx; a wrapper is the only way for this package to
// learn that a request completed, and without that a completed key would be
// answered 409 by its lock until the lock runs out. What the accessor
// hands the handler is the inner store's handle, which refuses to commit
// or roll back (idem.ErrTxOwned), as idem.TxFromContext's Tx does: only
// the middleware calls Complete and Rollback here.
type Tx struct {
	s     *Store
	inner idem.Tx
	lease *idemdriver.Lease
}

// Unwrap returns the inner store's transaction, in which the handler
// writes.
func (tx *Tx) Unwrap() idem.Tx { return tx.inner }

// Complete implements idem.Tx: the inner transaction commits the outcome;
// then the response is cached in Redis, for what is left of the record's
// life as the attempt's claim reported it (nothing, if that ran out: the
// store then keeps the record a TTL from the completion, which this
// process cannot time), and the lease lock is dropped.
func (tx *Tx) Complete(ctx context.Context, resp *idemdriver.Response) error {
	err := tx.inner.Complete(ctx, resp)
	if err == nil {
		tx.s.end(ctx, tx.lease, resp)
	}
	// A fenced attempt lost its lease (its lock ran out before the
	// takeover) or called Complete twice; any other failure leaves the
	// outcome unknown, and the caller fails or releases the lease next,
	// which ends it here too.
	return err
}

// Rollback implements idem.Tx. The lease stays: the caller releases or
// fails it next.
func (tx *Tx) Rollback(ctx context.Context) error { return tx.inner.Rollback(ctx) }
