package orders

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"
	"unicode/utf8"

	"github.com/idem-go/idem"
)

// ErrBadEvent is matched (errors.Is) by ApplyCreated's error for a body that
// is not an orders.created event: no retry makes it one, so a consumer drops
// the message (JetStream: Term) rather than redeliver it.
var ErrBadEvent = errors.New("orders: not an orders.created event")

// Receipt is what the receipts consumer writes for an orders.created event
// it applies. An order has one receipt once its event is applied: the
// consumer applies each message once while it remembers its id (idem.Do on
// the message id, for the key TTL), and the receipts table is unique on
// the event and its user for any replay later than that (AddReceipt).
type Receipt struct {
	// ID is the receipt's own id, "rcp_" and 24 random hex characters;
	// AddReceipt sets it when empty.
	ID       string
	OrderID  string
	EventID  string // EventID(OrderID)
	UserID   string
	Total    int64 // minor units of Currency
	Currency string
	// CreatedAt is when the receipt was written; AddReceipt sets it to the
	// current time (UTC, microseconds) when zero.
	CreatedAt time.Time
}

// ReceiptWriter adds receipts: both repositories implement it.
type ReceiptWriter interface {
	// AddReceipt inserts r, in the idempotent operation's transaction when
	// ctx belongs to one (idem.Do, the middleware), else in a statement
	// of its own, unless r.EventID already has a receipt of r.UserID: an
	// event has one receipt (a unique index on (event_id, user_id)
	// decides, never a read before the insert). It returns the event's
	// receipt, r as written or the one found, and whether it added r. A
	// receipt found for another order is an error. The key includes the
	// user, so that a database sharded by user can enforce it: a receipt
	// of the event for another user is not refused, and the caller must
	// write only receipts of the event's order's user (the consumer checks
	// the order first: CheckEventOrder).
	AddReceipt(ctx context.Context, r Receipt) (stored Receipt, added bool, err error)
}

var (
	_ ReceiptWriter = (*SQLiteRepository)(nil)
	_ ReceiptWriter = (*PostgresRepository)(nil)
)

// withDefaults fills in the receipt's id and time, and checks that it
// names an order.
func (r Receipt) withDefaults() (Receipt, error) {
	if r.OrderID == "" || r.EventID == "" || r.UserID == "" {
		return r, fmt.Errorf("orders: receipt %+v: order, event and user are required", r)
	}
	if r.ID == "" {
		r.ID = "rcp_" + hex.EncodeToString(randomBytes(12))
	}
	if r.CreatedAt.IsZero() {
		r.CreatedAt = time.Now()
	}
	r.CreatedAt = r.CreatedAt.UTC().Truncate(time.Microsecond)
	return r, nil
}

// ApplyCreated applies one orders.created event: it decodes body, the
// order's JSON (OrderJSON), and adds the order's receipt through w, in the
// idempotent operation's transaction when ctx belongs to one. It returns
// the event's receipt: the one written, or the one an earlier application
// wrote (a replay of the event, at any age, is a no-op).
//
// The body is read strictly: one JSON object of valid UTF-8, no unknown
// member, no member name repeated (exactly or differing only in case), with
// an order id, a user id, status "paid", a total of 0..MaxTotal, a currency
// that orders accept and a creation time. Anything else is an error
// matching ErrBadEvent, and nothing is written. Other errors come from w and
// may pass on a retry.
func ApplyCreated(ctx context.Context, w ReceiptWriter, body []byte) (Receipt, error) {
	o, err := DecodeCreated(body)
	if err != nil {
		return Receipt{}, err
	}
	r, err := Receipt{
		OrderID:  o.ID,
		EventID:  EventID(o.ID),
		UserID:   o.UserID,
		Total:    o.Total,
		Currency: o.Currency,
	}.withDefaults()
	if err != nil {
		return Receipt{}, err
	}
	stored, _, err := w.AddReceipt(ctx, r)
	if err != nil {
		return Receipt{}, err
	}
	return stored, nil
}

// ErrUnknownOrder is matched (errors.Is) by CheckEventOrder's error for an
// orders.created event that no order of the database backs: no order with
// its id for its user, or one whose total or currency is not the event's.
// The order commits before its event is published (in one transaction
// with its outbox row), so such an event was never the service's: a
// consumer drops it (JetStream: Term) and never writes its receipt.
var ErrUnknownOrder = errors.New("orders: no order of the database backs the event")

// OrderGetter reads one user's order; every Repository is one.
type OrderGetter interface {
	// Get returns userID's order id, or ErrNotFound.
	Get(ctx context.Context, userID, id string) (*Order, error)
}

// CheckEventOrder checks that ev, an order as an orders.created event
// carries it (DecodeCreated), is an order of the database that g reads:
// one with its id, of its user, with its total and currency. It returns
// nil when it is, an error matching ErrUnknownOrder when it is not, and
// g's error, which a retry may cure, when the database could not tell.
func CheckEventOrder(ctx context.Context, g OrderGetter, ev Order) error {
	o, err := g.Get(ctx, ev.UserID, ev.ID)
	switch {
	case errors.Is(err, ErrNotFound):
		return fmt.Errorf("%w: no order %s of user %q", ErrUnknownOrder, ev.ID, ev.UserID)
	case err != nil:
		return err
	case o.Total != ev.Total || o.Currency != ev.Currency:
		return fmt.Errorf("%w: order %s of user %q has a total of %d %s, the event %d %s",
			ErrUnknownOrder, ev.ID, ev.UserID, o.Total, o.Currency, ev.Total, ev.Currency)
	}
	return nil
}

// checkFound returns found, the receipt that rc's event already has, or an
// error when it is another order's.
func (rc Receipt) checkFound(found Receipt) (Receipt, bool, error) {
	if found.OrderID != rc.OrderID {
		return Receipt{}, false, fmt.Errorf("orders: event %s already has receipt %s, of order %s, not of %s",
			rc.EventID, found.ID, found.OrderID, rc.OrderID)
	}
	return found, false, nil
}

// DecodeCreated reads the order of an orders.created event's body, as
// strictly as ApplyCreated: an error matches ErrBadEvent. A consumer may
// call it before claiming the message, to drop a bad one at once.
func DecodeCreated(body []byte) (Order, error) {
	o, err := decodeCreated(body)
	if err != nil {
		return Order{}, fmt.Errorf("%w: %v", ErrBadEvent, err)
	}
	return o, nil
}

func decodeCreated(body []byte) (Order, error) {
	var o Order
	if !utf8.Valid(body) {
		return o, errors.New("the body is not valid UTF-8")
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&o); err != nil {
		return o, fmt.Errorf("the body is not an order: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return o, errors.New("the body holds more than one JSON value")
	}
	if err := idem.CheckMemberNames(body); err != nil {
		return o, err
	}
	switch {
	case !lookupID(o.ID):
		return o, fmt.Errorf("id %q is not an order id", o.ID)
	case CheckUser(o.UserID) != nil:
		return o, fmt.Errorf("user_id: %w", CheckUser(o.UserID))
	case o.Status != StatusPaid:
		return o, fmt.Errorf("status %q, want %q", o.Status, StatusPaid)
	case o.Total < 0 || o.Total > MaxTotal:
		return o, fmt.Errorf("total %d is outside 0..%d", o.Total, MaxTotal)
	case !IsCurrency(o.Currency):
		return o, fmt.Errorf("currency %q is not one orders accept", o.Currency)
	case o.CreatedAt.IsZero():
		return o, errors.New("created_at is missing")
	}
	return o, nil
}
