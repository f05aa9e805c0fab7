package ordersapp

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/orders"
)

// auditGroup is every record the audit read that names one order id, by
// source (the fields of each are listed with the sources' names).
type auditGroup struct {
	orders, ops, keys, charges, events, msgs, receipts [][]string
}

// merge walks the sorted sources together, one order id at a time, and
// judges each id with its group of records.
func (a *auditPass) merge(ctx context.Context) error {
	names := auditSources[:7] // srcPayments is checkPayments'
	srcs := make([]*sortedRecords, len(names))
	for i, name := range names {
		r, err := a.sorters[name].sorted()
		if err != nil {
			return err
		}
		defer r.Close()
		srcs[i] = r
	}
	var g auditGroup
	groups := []*[][]string{&g.orders, &g.ops, &g.keys, &g.charges, &g.events, &g.msgs, &g.receipts}
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		id, found := "", false
		for _, s := range srcs {
			if s.OK && (!found || s.Key() < id) {
				id, found = s.Key(), true
			}
		}
		if !found {
			return nil
		}
		for i, s := range srcs {
			*groups[i] = (*groups[i])[:0]
			for s.OK && s.Key() == id {
				*groups[i] = append(*groups[i], slices.Clone(s.Fields))
				if err := s.advance(); err != nil {
					return err
				}
			}
		}
		if err := a.judge(ctx, id, &g); err != nil {
			return err
		}
		a.read.judged.Add(1)
	}
}

// auditOrder is an order as the audit keeps it (srcOrders' fields).
type auditOrder struct {
	ID, UserID, Status, PaymentID, Key, Currency, BodyHash string
	CreatedAt, KeyCreatedAt                                time.Time
	EventAdded                                             bool
	Total                                                  int64
}

func auditOrderOf(f []string) auditOrder {
	return auditOrder{ID: f[0], UserID: f[1], Status: f[2], PaymentID: f[3], CreatedAt: fromMicros(f[4]), Key: f[5],
		KeyCreatedAt: fromMicros(f[6]), EventAdded: f[7] != "", Total: atoi64(f[8]), Currency: f[9], BodyHash: f[10]}
}

// judge checks the order id against everything that names it: its key,
// its payments, its event in the outbox and in the stream, its receipts.
func (a *auditPass) judge(ctx context.Context, id string, g *auditGroup) error {
	var o auditOrder
	ok := len(g.orders) > 0
	if ok {
		o = auditOrderOf(g.orders[0])
		if len(g.orders) > 1 {
			a.violate("order %s appears twice", id)
		}
	} else if !a.since.IsZero() && (len(g.charges) > 0 || len(g.events) > 0 || len(g.msgs) > 0 || len(g.receipts) > 0 || len(g.keys) > 0) {
		// Not an order of the window: of an operation that began
		// before it, when the order exists.
		exists, err := a.be.orderExists(ctx, id)
		if err != nil {
			return fmt.Errorf("looking up order %s: %w", id, err)
		}
		if exists {
			a.rep.OutsideWindow++
			return nil
		}
	}
	a.judgeOperation(id, g, ok, o)
	pendingKey := a.judgeKeys(id, g, ok, o)
	a.judgeCharges(id, g, ok, o, pendingKey)
	if a.rep.events.checked {
		a.judgeEvents(id, g, ok, o)
	}
	return nil
}

// judgeOperation: one order per operation (user, key and the key's
// CreatedAt). An order's id is the one its operation names, so two orders
// of one operation would share it; the orders whose id is not their
// operation's (srcOps) are counted with the order the operation names.
func (a *auditPass) judgeOperation(id string, g *auditGroup, ok bool, o auditOrder) {
	if len(g.ops) == 0 {
		return
	}
	var ids []string
	if ok && o.Key != "" && orders.OrderID(o.UserID, o.Key, o.KeyCreatedAt) == id {
		ids = append(ids, id)
	}
	for _, op := range g.ops {
		ids = append(ids, op[1])
	}
	if len(ids) > 1 {
		slices.Sort(ids)
		a.violate("user %q key %q made %d orders: %v", g.ops[0][2], g.ops[0][3], len(ids), ids)
	}
}

// judgeKeys: a stored success must have its order (invariant 3), another
// stored answer must not, and an order's key must have its answer; a key
// with no outcome may still be finished by the completer. It returns the
// key without an outcome that may still make the order (nil: none).
func (a *auditPass) judgeKeys(id string, g *auditGroup, ok bool, o auditOrder) *keyRow {
	var pending *keyRow
	for _, f := range g.keys {
		k := keyRow{User: f[1], Key: f[2], Status: int(atoi64(f[3])), LeaseUntil: fromMicros(f[4]), Attempts: int(atoi64(f[5])), Redrives: int(atoi64(f[6]))}
		switch {
		case k.Status == 0:
			pending = &k
			if ok && o.Key != "" {
				a.violate("order %s exists but its key %q has no stored answer", id, o.Key)
			}
		case k.Status >= 200 && k.Status < 300:
			if !ok {
				a.violate("user %q key %q stored a %d answer but order %s does not exist", k.User, k.Key, k.Status, id)
			}
		default:
			if ok {
				a.violate("user %q key %q stored a %d answer but order %s exists", k.User, k.Key, k.Status, id)
			}
		}
	}
	return pending
}

// judgeCharges: the order's succeeded payments (invariant 2). A payment
// whose order the database refused for good is refunded in full instead:
// that is a payment without an order and without money kept. A paid
// order's payment must not be refunded at all: the order says paid.
func (a *auditPass) judgeCharges(id string, g *auditGroup, ok bool, o auditOrder, k *keyRow) {
	var succeeded []string
	for _, f := range g.charges {
		pi, amount, refunded := f[1], atoi64(f[2]), atoi64(f[3])
		if a.checkSucceeded(id, pi, amount, refunded, ok, o, k) {
			succeeded = append(succeeded, pi)
		}
	}
	if len(succeeded) > 1 {
		slices.Sort(succeeded)
		a.violate("order %s has %d succeeded payments: %v", id, len(succeeded), succeeded)
	}
	if ok && o.Status == orders.StatusPaid && len(succeeded) == 0 {
		a.violate("paid order %s has no succeeded payment at the gateway (payment_id %s)", id, o.PaymentID)
	}
}

// checkSucceeded judges the succeeded payment pi of amount, of which
// refunded was given back, for order ref (o, when ok) or the key k that may
// still make it. It reports whether the payment counts as the order's (not
// when it was refunded in full without an order).
func (a *auditPass) checkSucceeded(ref, pi string, amount, refunded int64, ok bool, o auditOrder, k *keyRow) bool {
	switch {
	case ok && refunded > 0:
		a.violate("payment %s for order %s is refunded (%d of %d) but the order says %s", pi, ref, refunded, amount, o.Status)
		return true
	case !ok && refunded >= amount:
		a.rep.ChargesRefunded++
		return false
	}
	partly := ""
	if refunded > 0 {
		partly = fmt.Sprintf(" and is refunded only in part (%d of %d)", refunded, amount)
	}
	switch {
	case ok && o.PaymentID != pi:
		a.violate("payment %s for order %s, which was paid by %s", pi, ref, o.PaymentID)
	case ok:
	case k != nil && k.Redrives >= idem.DefaultCompleterMaxAttempts:
		a.violate("payment %s has no order%s: key %q of user %q was given up after %d re-drives (%d attempts in all)",
			pi, partly, k.Key, k.User, k.Redrives, k.Attempts)
	case k != nil && k.LeaseUntil.Before(a.now.Add(-giveUpAfter)):
		a.violate("payment %s has no order%s: key %q of user %q has had no attempt for over %s (%d attempts): no completer is finishing it",
			pi, partly, k.Key, k.User, giveUpAfter, k.Attempts)
	case k != nil:
		a.rep.Pending = append(a.rep.Pending, fmt.Sprintf("payment %s: order %s not made yet%s; key %q of user %q has no outcome after %d attempts (lease until %s)",
			pi, ref, partly, k.Key, k.User, k.Attempts, k.LeaseUntil.UTC().Format(time.RFC3339)))
	default:
		a.violate("payment %s (order_ref %q) has no order%s", pi, ref, partly)
	}
	return true
}

// judgeEvents: the order's event in the outbox and in stream ORDERS
// (invariant 5) and its receipts (invariant 6).
func (a *auditPass) judgeEvents(id string, g *auditGroup, ok bool, o auditOrder) {
	ev := &a.rep.events
	// aged: the order is older than the stream's maximum age (set by an
	// operator: serve creates the stream without one), which may have
	// removed its message. The margin covers the skew between the
	// database's clock and the NATS servers'.
	aged := ok && ev.MaxAge > 0 && o.CreatedAt.Before(a.now.Add(-ev.MaxAge+streamAgeMargin))

	// The outbox: srcEvents' fields are order id, event id, subject,
	// sent, body hash; sorted by event id within the order.
	n := 0
	for i, e := range g.events {
		if i > 0 && g.events[i-1][1] == e[1] {
			a.violate("event %s is in the outbox twice", e[1])
		}
		switch {
		case e[2] != eventSubject:
			a.violate("event %s in the outbox has subject %q, want %s", e[1], e[2], eventSubject)
		case !ok:
			a.violate("event %s in the outbox has no order (%s does not exist)", e[1], id)
		default:
			n++
			if e[4] != o.BodyHash {
				a.violate("event %s's body is not order %s as the API shows it", e[1], id)
			}
		}
	}
	evtID := orders.EventID(id)
	swept := false
	if ok {
		switch {
		case n == 0 && o.EventAdded:
			// Added with the order, and only a sent event is ever deleted:
			// swept. Its message is checked below, against the order.
			ev.EventsSwept++
			swept = true
			n = 1
		case n == 0:
			a.violate("order %s has no orders.created event in the outbox", id)
		case n > 1:
			a.violate("order %s has %d orders.created events in the outbox", id, n)
		}
		ev.EventsPerOrder[n]++
	}
	eventOf := func(msgID string) []string {
		for _, e := range g.events {
			if e[1] == msgID {
				return e
			}
		}
		return nil
	}

	// The stream: srcMessages' fields are order id, message id, sequence,
	// body hash; sorted by message id, then sequence.
	inStream := map[string]bool{}
	var firstSeq uint64 // of the order's own event's message
	for i, m := range g.msgs {
		ev.StreamMsgs++
		if i > 0 && g.msgs[i-1][1] == m[1] {
			ev.Repeats++
			continue
		}
		ev.StreamIDs++
		inStream[m[1]] = true
		if m[1] == evtID {
			firstSeq = binary.BigEndian.Uint64([]byte(m[2]))
		}
		e := eventOf(m[1])
		switch {
		case e == nil && swept && m[1] == evtID:
			if m[3] != o.BodyHash {
				seq := binary.BigEndian.Uint64([]byte(m[2]))
				a.violate("message %d of stream %s (Nats-Msg-Id %s) is not order %s as the API shows it (its event was swept from the outbox)", seq, eventStream, m[1], id)
			}
		case e == nil:
			seq := binary.BigEndian.Uint64([]byte(m[2]))
			a.violate("message %d of stream %s (Nats-Msg-Id %s) is no event of the outbox: no order %s", seq, eventStream, m[1], id)
		case m[3] != e[4]:
			seq := binary.BigEndian.Uint64([]byte(m[2]))
			a.violate("message %d of stream %s (Nats-Msg-Id %s) differs from its event in the outbox", seq, eventStream, m[1])
		case e[3] == "":
			ev.PublishedUnmarked++
		}
	}
	for i, e := range g.events {
		switch {
		case i > 0 && g.events[i-1][1] == e[1]:
		case !a.streamExists || e[3] == "" || inStream[e[1]]:
		case aged:
			ev.AgedOut++
		default:
			a.violate("event %s is marked sent but stream %s has no message with its id", e[1], eventStream)
		}
	}
	if swept && !inStream[evtID] {
		if aged {
			ev.AgedOut++
		} else {
			a.violate("event %s of order %s is no longer in the outbox (swept once sent, or deleted) but stream %s has no message with its id", evtID, id, eventStream)
		}
	}

	// The receipts: srcReceipts' fields are order id, receipt id, event
	// id, user, total, currency; sorted by receipt id.
	for _, r := range g.receipts {
		switch {
		case !ok:
			a.violate("receipt %s is for order %s, which does not exist", r[1], id)
		case r[2] != evtID || r[3] != o.UserID || atoi64(r[4]) != o.Total || r[5] != o.Currency:
			a.violate("receipt %s (event %s, user %q, %s %s) does not match order %s (user %q, %d %s)",
				r[1], r[2], r[3], r[4], r[5], id, o.UserID, o.Total, o.Currency)
		}
	}
	if !ok {
		return
	}
	n = len(g.receipts)
	if n > 1 {
		ids := make([]string, n)
		for i, r := range g.receipts {
			ids[i] = r[1]
		}
		a.violate("order %s has %d receipts: %v", id, n, ids)
	}
	if !inStream[evtID] {
		// Not published yet, and its receipt cannot be due; or its
		// message is past the stream's maximum age, and the consumer had
		// to apply it before then.
		if e := eventOf(evtID); n == 0 && aged && (e != nil && e[3] != "" || swept) {
			a.violate("order %s's event %s was removed from stream %s by its maximum age (%s) before the consumer wrote its receipt", id, evtID, eventStream, ev.MaxAge)
		}
		return
	}
	ev.ReceiptsPerOrder[n]++
	if n == 0 {
		if firstSeq <= a.ackFloor {
			ev.AckedWithoutReceipt++
			a.violate("order %s's event %s was acknowledged by consumer %s but has no receipt (message %d; the consumer's ack floor is %d)",
				id, evtID, receiptsDurable, firstSeq, a.ackFloor)
		} else {
			ev.ReceiptsPending++
		}
	}
}
