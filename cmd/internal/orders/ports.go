package orders

import (
	"context"
	"errors"
	"time"
)

// ErrDeclined is matched (errors.Is) by the error a Payer returns when the
// gateway declined the payment: a final outcome, answered 402 and stored.
// Any other Pay error is a gateway failure, answered 502 and not stored, so
// the client's retry pays again with the same key.
var ErrDeclined = errors.New("orders: payment declined")

// Payer makes payments.
type Payer interface {
	// Pay charges req.Amount. The same req.IdempotencyKey must never
	// charge twice: a repeat returns the first payment's result.
	Pay(ctx context.Context, req PaymentRequest) (PaymentResult, error)
	// Refund refunds req.PaymentID in full. The same req.IdempotencyKey
	// must never refund twice: a payment already refunded by that key is
	// success (nil). Any error means the refund may not have been made, and
	// the caller tries again later with the same key.
	Refund(ctx context.Context, req RefundRequest) error
	// FindPayment looks up the succeeded payment made for the order
	// orderRef (PaymentRequest.OrderRef): its result and true, or false
	// when the gateway knows of none. The handler calls it before paying
	// on every attempt after an operation's first, whose payment the
	// gateway may have made and then forgotten the idempotency key of. An
	// error means the gateway could not tell.
	FindPayment(ctx context.Context, orderRef string) (PaymentResult, bool, error)
}

// RefundRequest is the full refund of one payment.
type RefundRequest struct {
	// PaymentID is the gateway's payment id (PaymentResult.ID).
	PaymentID string
	// IdempotencyKey names the refund: the same key never refunds twice.
	IdempotencyKey string
}

// PaymentRequest is one payment. Amount is in minor units of Currency (three
// capital letters).
type PaymentRequest struct {
	Amount         int64
	Currency       string
	IdempotencyKey string
	// OrderRef is the id of the order the payment is for.
	OrderRef string
}

// PaymentResult is a successful payment.
type PaymentResult struct {
	// ID is the gateway's payment id, such as a PaymentIntent's pi_….
	ID string
}

// Errors returned by a Repository.
var (
	// ErrNotFound: no such order for this user.
	ErrNotFound = errors.New("orders: order not found")
	// ErrExists: an order with this id, or for this user's idempotency
	// key, already exists.
	ErrExists = errors.New("orders: order already exists")
	// ErrUnwritable: the database refused the order for good, whatever
	// the retries (PostgreSQL's data exceptions, SQLSTATE class 22, and its
	// integrity violations, class 23, other than those that mean ErrExists;
	// SQLite's equivalents). The order can never be written, so its payment
	// must be refunded.
	ErrUnwritable = errors.New("orders: the database refuses the order")
)

// TxKeeper is implemented by a Repository whose database ends a
// transaction left idle too long (PostgreSQL's
// idle_in_transaction_session_timeout, which the service sets to the key
// lease so that an instance cut off mid-transaction does not hold its
// locks). The handler calls KeepTx before the one slow call it makes with
// the request's transaction open, the refund of an order the database
// refused, so that the transaction is kept for at least d; the setting
// ends with the transaction. Outside an idempotent request's transaction
// KeepTx does nothing.
type TxKeeper interface {
	KeepTx(ctx context.Context, d time.Duration) error
}

// Repository stores orders.
type Repository interface {
	// Create inserts o and its orders.created event (EventFor, into the
	// outbox table of package outbox), together: in the idempotent
	// request's transaction when ctx belongs to one, else in a
	// transaction of its own. It returns ErrExists when the user's order
	// id or (user, key) is taken, and ErrUnwritable when the database refuses o for
	// good. When it fails, neither is written, and the request's
	// transaction is left as it was before the call (Create writes in a
	// savepoint of it) and can still commit the request's answer.
	Create(ctx context.Context, o *Order) error
	// Get returns userID's order id, or ErrNotFound (also when the order
	// belongs to another user).
	Get(ctx context.Context, userID, id string) (*Order, error)
	// List returns up to limit of userID's orders, newest first, after the
	// order startingAfter when it is not empty, and whether more follow.
	// It returns ErrNotFound when startingAfter names none of userID's
	// orders.
	List(ctx context.Context, userID string, limit int, startingAfter string) ([]Order, bool, error)
	// Ping reports whether the database answers.
	Ping(ctx context.Context) error
}
