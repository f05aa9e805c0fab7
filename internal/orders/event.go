package orders

import (
	"encoding/json"
	"fmt"
	"strings"
)

// EventSubject is the subject of the event that every order emits once,
// written with the order by Repository.Create (see EventFor).
const EventSubject = "orders.created"

// EventID returns the id of orderID's orders.created event: "evt_" and the
// 24 hex characters of an "ord_…" id (an id without that prefix is kept
// whole). It is the broker's deduplication id (Nats-Msg-Id), the same for
// every attempt at one order.
func EventID(orderID string) string {
	return "evt_" + strings.TrimPrefix(orderID, "ord_")
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
