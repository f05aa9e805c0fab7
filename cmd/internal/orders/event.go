package orders

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/idem-go/idem/outbox"
)

// EventSubject is the subject of the event that every order emits once,
// written with the order by Repository.Create (see EventFor).
const EventSubject = "orders.created"

// EventID returns the id of orderID's orders.created event: "evt_" and the
// 24 hex characters of the service's "ord_…" ids. It is the broker's
// deduplication id (Nats-Msg-Id), the same for every attempt at one order.
// An id without the "ord_" prefix (none that the service makes) gets
// "evt-" and the whole id, so that no two order ids share an event id.
func EventID(orderID string) string {
	if rest, ok := strings.CutPrefix(orderID, "ord_"); ok {
		return "evt_" + rest
	}
	return "evt-" + orderID
}

// EventFor returns the orders.created event of o, as Repository.Create
// writes it with the order: ID EventID(o.ID), Subject EventSubject,
// OrderingKey the user id (one user's events are published in order), Body
// OrderJSON(o). CreatedAt is left for the outbox to set. o is taken as a
// repository returns it (see OrderJSON), so an audit that reads an order
// back gets the body of its event.
func EventFor(o *Order) (outbox.Event, error) {
	body, err := OrderJSON(o)
	if err != nil {
		return outbox.Event{}, err
	}
	return outbox.Event{ID: EventID(o.ID), Subject: EventSubject, OrderingKey: o.UserID, Body: body}, nil
}

// OrderJSON returns the order's JSON exactly as GET /v1/orders/{id} shows
// it, trailing newline included: the body of its orders.created event. o is
// taken as a repository returns it: CreatedAt is shown in UTC, and the
// items as they read back from the JSON the repositories store. CreatedAt
// must already have the precision of the database (the service writes
// microseconds; PostgreSQL keeps no more).
func OrderJSON(o *Order) ([]byte, error) {
	shown := *o
	shown.CreatedAt = o.CreatedAt.UTC()
	items, err := json.Marshal(o.Items)
	if err != nil {
		return nil, fmt.Errorf("orders: encoding items: %w", err)
	}
	shown.Items = nil
	if err := json.Unmarshal(items, &shown.Items); err != nil {
		return nil, fmt.Errorf("orders: decoding items: %w", err)
	}
	b, err := marshalJSON(&shown)
	if err != nil {
		return nil, fmt.Errorf("orders: encoding order %s: %w", o.ID, err)
	}
	return b, nil
}

// eventError translates the outbox's error on adding o's event. An event
// with o's id when o itself was new (the order insert passed) is one
// without its order: every attempt at o fails the same way, so o can
// never be written (ErrUnwritable, and its payment is refunded).
func eventError(o *Order, err error) error {
	if errors.Is(err, outbox.ErrExists) {
		return fmt.Errorf("%w: the event of order %s exists without it: %w", ErrUnwritable, o.ID, err)
	}
	return fmt.Errorf("orders: adding the event of order %s: %w", o.ID, err)
}
