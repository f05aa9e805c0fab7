package idem

import (
	"context"
)

// ChildKey returns the Idempotency-Key for a downstream call (a payment, a
// message, another service's POST) made by the claimed request that ctx
// belongs to; step names the call ("charge", "refund", "ship"). See
// Lease.ChildKey. Outside a claimed request it returns ErrNoTx.
func ChildKey(ctx context.Context, step string) (string, error) {
	l, ok := LeaseFromContext(ctx)
	if !ok {
		return "", ErrNoTx
	}
	return l.ChildKey(step), nil
}
