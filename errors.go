package idem

import (
	"errors"
	"fmt"
	"time"
)

// Sentinel errors returned by stores and the middleware. Compare with errors.Is.
var (
	// ErrKeyMissing: the request has no Idempotency-Key and one is required.
	ErrKeyMissing = errors.New("idem: Idempotency-Key header is required")
	// ErrKeyInvalid: the Idempotency-Key header is not a valid key.
	ErrKeyInvalid = errors.New("idem: invalid Idempotency-Key")
	// ErrFingerprintMismatch: the key was first used with another request.
	ErrFingerprintMismatch = errors.New("idem: key reused with a different request")
	// ErrInFlight: another attempt with the same key holds a live lease.
	ErrInFlight = errors.New("idem: a request with this key is still in flight")
	// ErrFenced: the caller's lease was taken over; its work must not commit.
	ErrFenced = errors.New("idem: lease lost to another attempt")
	// ErrNotDue: a completer's claim (ClaimParams.Redrive) found its
	// operation gone, answered, replaced, or not due yet; nothing changed.
	ErrNotDue = errors.New("idem: the re-driven operation is not due")
	// ErrRequestTooLarge: the request body exceeds Options.MaxRequestBody.
	ErrRequestTooLarge = errors.New("idem: request body too large")
	// ErrBadTarget: the request target (path and query) is not valid
	// UTF-8, which no store can keep; it is a client's mistake (RFC 3986
	// wants such bytes percent-encoded).
	ErrBadTarget = errors.New("idem: request target is not valid UTF-8")
	// ErrBadBody: the request body could not be read.
	ErrBadBody = errors.New("idem: request body unreadable")
	// ErrHandlerPanicked: the wrapped handler panicked; it reaches
	// Options.ErrorHandler. Do returns it, wrapped, when its function
	// panicked.
	ErrHandlerPanicked = errors.New("idem: handler panicked")
	// ErrForeignTx: a store's FromContext found the transaction of another
	// store; writing outside it would break the atomicity of the outcome.
	ErrForeignTx = errors.New("idem: the request's transaction belongs to another store")
	// ErrTxOwned: the handler (or a Do function) asked to commit or roll
	// back the request's transaction. The middleware owns it: it commits
	// the handler's writes together with the stored answer, or rolls
	// them back, once the handler returned. Every store's handle on the
	// transaction (pgstore.FromContext's pgx.Tx, sqlitestore.HandlerTx,
	// memstore.FromContext's Tx, the Tx of TxFromContext) refuses with an
	// error that matches it, and changes nothing: the transaction stays
	// open, and what the handler wrote commits with its answer.
	ErrTxOwned = errors.New("idem: the middleware commits or rolls back the request's transaction; the handler must not")
	// ErrSettled: TxFromContext was called after the claimed request was
	// answered (from a goroutine the handler left running). It does not
	// match ErrNoTx on purpose: code that reads ErrNoTx as "not an
	// idempotent request, write on your own" must not commit such a late
	// write outside the request's transaction.
	ErrSettled = errors.New("idem: the idempotent request was already answered; its transaction is over")
	// ErrNoTx: TxFromContext was called outside a claimed request.
	ErrNoTx = errors.New("idem: no idempotent transaction in context")
	// ErrStoreUnavailable wraps store failures reported to clients.
	ErrStoreUnavailable = errors.New("idem: idempotency store unavailable")
)

// InFlightError is returned by Store.Claim when another attempt holds the key.
// It matches ErrInFlight with errors.Is.
type InFlightError struct {
	// LeaseUntil is when the current holder's lease runs out.
	LeaseUntil time.Time
}

func (e *InFlightError) Error() string {
	return fmt.Sprintf("%v (lease until %s)", ErrInFlight, e.LeaseUntil.UTC().Format(time.RFC3339Nano))
}

// Is reports whether target is ErrInFlight.
func (e *InFlightError) Is(target error) bool { return target == ErrInFlight }
