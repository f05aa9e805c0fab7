package idem

import (
	"context"
	"fmt"

	"github.com/idem-go/idem/idemdriver"
)

// handlerTx is the Tx that TxFromContext hands to the handler (or to a
// Do function): the request's transaction, whose Complete and Rollback
// are the middleware's to call. Its own refuse with ErrTxOwned and change
// nothing; Unwrap returns the store's transaction, for the stores'
// FromContext accessors (see UnwrapTx). It holds the request's state, a
// pointer, so that handing it out as a Tx allocates nothing.
type handlerTx struct {
	st *requestState
}

// Unwrap returns the store's transaction (see UnwrapTx).
func (h handlerTx) Unwrap() Tx {
	h.st.mu.Lock()
	defer h.st.mu.Unlock()
	return h.st.tx
}

// Complete refuses: the middleware completes the request's transaction
// with its answer once the handler returned.
func (handlerTx) Complete(context.Context, *idemdriver.Response) error {
	return fmt.Errorf("idem: Complete from the handler: %w", ErrTxOwned)
}

// Rollback refuses: the middleware rolls the request's transaction back
// when the handler's answer is not stored.
func (handlerTx) Rollback(context.Context) error {
	return fmt.Errorf("idem: Rollback from the handler: %w", ErrTxOwned)
}
