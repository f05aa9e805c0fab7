package ordersapp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/outbox"
)

// The audit's bounds on reading stream ORDERS.
const (
	// auditStreamStall bounds the read of the stream: it gives up when no
	// message came for this long (each fetch waits auditFetchWait), however
	// long the whole read takes; and each call to JetStream's API (the
	// stream, its last message, the consumer's ack floor) within it.
	auditStreamStall   = 2 * time.Minute
	auditFetchBatch    = 1000
	auditFetchWait     = time.Second // how long one fetch waits for its first message
	auditResetAttempts = 12          // tries to make the ordered consumer of one fetch, 1s to 10s apart
	auditNoLeaderWait  = 30 * time.Second
)

// whileNoResponders runs f until it returns anything but "no responders",
// for at most wait, 250 ms doubling to 2 s apart. A JetStream cluster
// has no responder for its API while it elects a leader: for some
// seconds after one of its servers died or came back (the election alone
// takes 4 to 9 s). A server without JetStream never answers: f's error
// comes back once wait is over.
func whileNoResponders[T any](ctx context.Context, wait time.Duration, f func() (T, error)) (T, error) {
	deadline := time.Now().Add(wait)
	pause := 250 * time.Millisecond
	for {
		v, err := f()
		if !errors.Is(err, nats.ErrNoResponders) || time.Now().Add(pause).After(deadline) {
			return v, err
		}
		select {
		case <-ctx.Done():
			return v, err
		case <-time.After(pause):
		}
		pause = min(2*pause, 2*time.Second)
	}
}

// streamMsg is what the audit reads of one message of stream ORDERS.
type streamMsg struct {
	seq  uint64
	id   string // Nats-Msg-Id
	body []byte
}

// readStream reads every orders.created message of stream ORDERS, oldest
// first, through an ordered consumer, up to the last message of that
// subject when the read began. A fetch that comes back empty before it
// does not end the read: on a loaded machine or a slow link a fetch can
// wait out its time before its first message arrives, and the next one
// starts again after the last message received. The read has no deadline
// of its own, since a stream of millions of messages takes minutes: it
// ends with an error when auditStreamStall passes without a message.
// exists is false when there is no such stream; maxAge is the stream's
// maximum age (0: none).
func readStream(ctx context.Context, js jetstream.JetStream, read *atomic.Int64) (msgs []streamMsg, exists bool, maxAge time.Duration, err error) {
	return readStreamFetching(ctx, js, read, nil)
}

// readStreamFetching is readStream, calling beforeFetch (tests only; nil
// in the audit) before each fetch. It adds each message it reads to read.
func readStreamFetching(ctx context.Context, js jetstream.JetStream, read *atomic.Int64, beforeFetch func()) (msgs []streamMsg, exists bool, maxAge time.Duration, err error) {
	callCtx, cancel := context.WithTimeout(ctx, auditStreamStall)
	defer cancel()
	st, err := whileNoResponders(callCtx, auditNoLeaderWait, func() (jetstream.Stream, error) { return js.Stream(callCtx, eventStream) })
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, false, 0, nil
	}
	if err != nil {
		return nil, false, 0, fmt.Errorf("stream %s: %w", eventStream, err)
	}
	maxAge = st.CachedInfo().Config.MaxAge
	// The last message there is, not the stream's last sequence: a
	// message deleted by hand (or by a limit) leaves that sequence behind
	// with nothing at it, and the read would wait for it until its
	// deadline.
	lastMsg, err := whileNoResponders(callCtx, auditNoLeaderWait, func() (*jetstream.RawStreamMsg, error) {
		return st.GetLastMsgForSubject(callCtx, eventSubject)
	})
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, true, maxAge, nil
	}
	if err != nil {
		return nil, true, 0, fmt.Errorf("stream %s: %w", eventStream, err)
	}
	last := lastMsg.Sequence
	// Each fetch of an ordered consumer makes its server-side consumer
	// again, retrying with a backoff (1s doubling to 10s) as often as
	// MaxResetAttempts allows: left at zero, for ever, whatever ctx says
	// (nats-server 2.9 refuses new consumers of a replicated stream for
	// about a minute after one of its servers dies, and the audit hung).
	// Making it the first time is not retried by the client: a consumer
	// is made by the stream's leader, and a cluster electing one has no
	// responder.
	cons, err := whileNoResponders(callCtx, auditNoLeaderWait, func() (jetstream.Consumer, error) {
		return st.OrderedConsumer(callCtx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{eventSubject}, DeliverPolicy: jetstream.DeliverAllPolicy,
			MaxResetAttempts: auditResetAttempts})
	})
	if err != nil {
		return nil, true, 0, fmt.Errorf("reading stream %s: %w", eventStream, err)
	}
	lastProgress := time.Now()
	for {
		if err := ctx.Err(); err != nil {
			return nil, true, 0, fmt.Errorf("reading stream %s: %w", eventStream, err)
		}
		if time.Since(lastProgress) > auditStreamStall {
			return nil, true, 0, fmt.Errorf("reading stream %s: no message for %s after %d, up to sequence %d", eventStream, auditStreamStall, len(msgs), last)
		}
		if beforeFetch != nil {
			beforeFetch()
		}
		batch, err := cons.Fetch(auditFetchBatch, jetstream.FetchMaxWait(auditFetchWait))
		if err != nil {
			return nil, true, 0, fmt.Errorf("reading stream %s: %w", eventStream, err)
		}
		n, done := 0, false
		for m := range batch.Messages() {
			n++
			md, err := m.Metadata()
			if err != nil {
				return nil, true, 0, fmt.Errorf("reading stream %s: %w", eventStream, err)
			}
			msgs = append(msgs, streamMsg{seq: md.Sequence.Stream, id: m.Headers().Get(jetstream.MsgIDHeader), body: m.Data()})
			read.Add(1)
			if md.Sequence.Stream >= last {
				done = true
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) {
			return nil, true, 0, fmt.Errorf("reading stream %s: %w", eventStream, err)
		}
		if done {
			return msgs, true, maxAge, nil
		}
		if n > 0 {
			lastProgress = time.Now()
		}
	}
}

// eventAudit is what the audit found of the order events (invariants 5
// and 6).
type eventAudit struct {
	checked bool // false: no NATS to read (never in `orders audit`)

	Events, EventsSent, EventsUnsent int
	// EventsSwept: orders marked with their event (orders.Order.EventAdded)
	// whose event is no longer in the outbox: sent, then deleted by serve's
	// sweep (--outbox-retention). Each must have its message in the
	// stream, which is checked against the order instead.
	EventsSwept int
	// PublishedUnmarked: unsent events already in the stream (the relay
	// published them and has not marked them sent yet, or died between).
	PublishedUnmarked int
	StreamMsgs        int
	StreamIDs         int // distinct Nats-Msg-Id
	Repeats           int // messages whose Nats-Msg-Id came before (past the duplicate window)
	EventsPerOrder    map[int]int
	Receipts          int
	ReceiptsPerOrder  map[int]int // of the orders whose event is in the stream
	ReceiptsPending   int         // events in the stream without a receipt yet, past the consumer's ack floor
	// AckedWithoutReceipt: events the consumer acknowledged (at or below
	// its ack floor) without a receipt; each is a violation.
	AckedWithoutReceipt int
	// MaxAge is the stream's maximum age (0: none); AgedOut counts the
	// sent events whose message it removed (their orders are older than
	// it): not violations, as long as their receipts were written.
	MaxAge  time.Duration
	AgedOut int
}

// readEvents checks every order's event in the outbox and in stream
// ORDERS (invariant 5) and its receipts (invariant 6). It needs the orders
// (readOrders).
func (a *auditPass) readEvents(ctx context.Context, be *backend, js jetstream.JetStream) error {
	ev := &a.rep.events
	ev.checked = true
	ev.EventsPerOrder, ev.ReceiptsPerOrder = map[int]int{}, map[int]int{}

	// The outbox first, then the stream: an event marked sent before the
	// outbox was read was published before, so the stream has it.
	type event struct {
		e    outbox.Event
		sent bool
	}
	byEvent := map[string]event{}
	perOrder := map[string]int{}
	err := be.outbox.Each(ctx, func(e outbox.Event, sentAt time.Time) error {
		a.read.events.Add(1)
		ev.Events++
		sent := !sentAt.IsZero()
		if sent {
			ev.EventsSent++
		} else {
			ev.EventsUnsent++
		}
		if _, dup := byEvent[e.ID]; dup {
			a.violate("event %s is in the outbox twice", e.ID)
		}
		byEvent[e.ID] = event{e, sent}
		id := orderOfEvent(e.ID)
		o, ok := a.byID[id]
		switch {
		case e.Subject != eventSubject:
			a.violate("event %s in the outbox has subject %q, want %s", e.ID, e.Subject, eventSubject)
		case !ok:
			a.violate("event %s in the outbox has no order (%s does not exist)", e.ID, id)
		default:
			perOrder[id]++
			if want, err := orders.OrderJSON(&o); err != nil {
				return err
			} else if !bytes.Equal(e.Body, want) {
				a.violate("event %s's body is not order %s as the API shows it", e.ID, id)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("reading the outbox: %w", err)
	}
	swept := map[string]bool{} // event ids of the marked orders without their event in the outbox
	for id, o := range a.byID {
		n := perOrder[id]
		switch {
		case n == 0 && o.EventAdded:
			// Added with the order, and only a sent event is ever deleted:
			// swept. Its message is checked below, against the order.
			ev.EventsSwept++
			swept[orders.EventID(id)] = true
			n = 1
		case n == 0:
			a.violate("order %s has no orders.created event in the outbox", id)
		case n > 1:
			a.violate("order %s has %d orders.created events in the outbox", id, n)
		}
		ev.EventsPerOrder[n]++
	}

	// A stream with a maximum age (set by an operator: serve creates it
	// without one) removes the messages older than it. An order created
	// before the horizon may have lost its message that way; one created
	// after it may not. The margin covers the skew between the database's
	// clock and the NATS servers'.
	msgs, exists, maxAge, err := readStream(ctx, js, &a.read.messages)
	if err != nil {
		return err
	}
	ev.MaxAge = maxAge
	aged := func(eventID string) bool {
		o, ok := a.byID[orderOfEvent(eventID)]
		return ok && ev.MaxAge > 0 && o.CreatedAt.Before(a.now.Add(-ev.MaxAge+streamAgeMargin))
	}
	if !exists && ev.EventsSent > 0 {
		// Not one violation per event: the audit reads another NATS than
		// the one the relay published to, or the stream was deleted.
		a.violate("stream %s does not exist on this NATS, but %d events are marked sent: is it the NATS that serve publishes to (--nats-url)?", eventStream, ev.EventsSent)
	}
	inStream := map[string]int{}    // message id → messages
	firstSeq := map[string]uint64{} // message id → its first message's sequence
	for _, m := range msgs {
		ev.StreamMsgs++
		if m.id == "" {
			a.violate("message %d of stream %s has no Nats-Msg-Id", m.seq, eventStream)
			continue
		}
		inStream[m.id]++
		if inStream[m.id] == 1 {
			firstSeq[m.id] = m.seq
		}
		if inStream[m.id] > 1 {
			ev.Repeats++
			continue
		}
		ev.StreamIDs++
		e, ok := byEvent[m.id]
		switch {
		case !ok && swept[m.id]:
			o := a.byID[orderOfEvent(m.id)]
			if want, err := orders.OrderJSON(&o); err != nil {
				return err
			} else if !bytes.Equal(m.body, want) {
				a.violate("message %d of stream %s (Nats-Msg-Id %s) is not order %s as the API shows it (its event was swept from the outbox)", m.seq, eventStream, m.id, o.ID)
			}
		case !ok:
			a.violate("message %d of stream %s (Nats-Msg-Id %s) is no event of the outbox: no order %s", m.seq, eventStream, m.id, orderOfEvent(m.id))
		case !bytes.Equal(m.body, e.e.Body):
			a.violate("message %d of stream %s (Nats-Msg-Id %s) differs from its event in the outbox", m.seq, eventStream, m.id)
		case !e.sent:
			ev.PublishedUnmarked++
		}
	}
	for id, e := range byEvent {
		switch {
		case !exists || !e.sent || inStream[id] > 0:
		case aged(id):
			ev.AgedOut++
		default:
			a.violate("event %s is marked sent but stream %s has no message with its id", id, eventStream)
		}
	}
	for id := range swept {
		switch {
		case inStream[id] > 0:
		case aged(id):
			ev.AgedOut++
		default:
			a.violate("event %s of order %s is no longer in the outbox (swept once sent, or deleted) but stream %s has no message with its id", id, orderOfEvent(id), eventStream)
		}
	}

	// The consumer's ack floor, before the receipts: it acknowledges a
	// message only after its receipt committed (or, on a mismatch,
	// terminates it without one), so every message at or below the floor
	// read here has its receipt among those read next.
	ackFloor, err := receiptsAckFloor(ctx, js)
	if err != nil {
		return err
	}

	// The receipts, after the stream: a receipt was written from a
	// message that the stream had before.
	receipts := map[string][]string{}
	err = be.allReceipts(ctx, func(r orders.Receipt) error {
		a.read.receipts.Add(1)
		ev.Receipts++
		receipts[r.OrderID] = append(receipts[r.OrderID], r.ID)
		o, ok := a.byID[r.OrderID]
		switch {
		case !ok:
			a.violate("receipt %s is for order %s, which does not exist", r.ID, r.OrderID)
		case r.EventID != orders.EventID(o.ID) || r.UserID != o.UserID || r.Total != o.Total || r.Currency != o.Currency:
			a.violate("receipt %s (event %s, user %q, %d %s) does not match order %s (user %q, %d %s)",
				r.ID, r.EventID, r.UserID, r.Total, r.Currency, o.ID, o.UserID, o.Total, o.Currency)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("reading receipts: %w", err)
	}
	for id := range a.byID {
		n := len(receipts[id])
		if n > 1 {
			sort.Strings(receipts[id])
			a.violate("order %s has %d receipts: %v", id, n, receipts[id])
		}
		if evt := orders.EventID(id); inStream[evt] == 0 {
			// Not published yet, and its receipt cannot be due; or its
			// message is past the stream's maximum age, and the consumer
			// had to apply it before then.
			if n == 0 && aged(evt) && (byEvent[evt].sent || swept[evt]) {
				a.violate("order %s's event %s was removed from stream %s by its maximum age (%s) before the consumer wrote its receipt", id, evt, eventStream, ev.MaxAge)
			}
			continue
		}
		ev.ReceiptsPerOrder[n]++
		if n == 0 {
			if seq := firstSeq[orders.EventID(id)]; seq <= ackFloor {
				ev.AckedWithoutReceipt++
				a.violate("order %s's event %s was acknowledged by consumer %s but has no receipt (message %d; the consumer's ack floor is %d)",
					id, orders.EventID(id), receiptsDurable, seq, ackFloor)
			} else {
				ev.ReceiptsPending++
			}
		}
	}
	return nil
}

// streamAgeMargin is how much older than the stream's maximum age an
// order must be before the audit accepts that its message is gone.
const streamAgeMargin = time.Minute

// receiptsAckFloor returns the stream sequence up to which the durable
// consumer receipts has acknowledged every message (0 when it does not
// exist yet).
func receiptsAckFloor(ctx context.Context, js jetstream.JetStream) (uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, auditStreamStall)
	defer cancel()
	cons, err := js.Consumer(ctx, eventStream, receiptsDurable)
	if errors.Is(err, jetstream.ErrConsumerNotFound) || errors.Is(err, jetstream.ErrStreamNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("consumer %s of stream %s: %w", receiptsDurable, eventStream, err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("consumer %s of stream %s: %w", receiptsDurable, eventStream, err)
	}
	return info.AckFloor.Stream, nil
}

// orderOfEvent is the order id of event id evt_… (orders.EventID).
func orderOfEvent(id string) string {
	return "ord_" + strings.TrimPrefix(id, "evt_")
}

// histogram writes counts (how many orders have n of something) as
// "200 orders with 1, 2 with 0", the largest group first.
func histogram(counts map[int]int) string {
	if len(counts) == 0 {
		return "no orders"
	}
	ns := make([]int, 0, len(counts))
	for n := range counts {
		ns = append(ns, n)
	}
	sort.Slice(ns, func(i, j int) bool {
		return counts[ns[i]] > counts[ns[j]] || counts[ns[i]] == counts[ns[j]] && ns[i] < ns[j]
	})
	parts := make([]string, len(ns))
	for i, n := range ns {
		if i == 0 {
			parts[i] = fmt.Sprintf("%d orders with %d", counts[n], n)
		} else {
			parts[i] = fmt.Sprintf("%d with %d", counts[n], n)
		}
	}
	return strings.Join(parts, ", ")
}

// print writes the events' lines of the report.
func (ev *eventAudit) print(w io.Writer) {
	if !ev.checked {
		return
	}
	fmt.Fprintf(w, "events:            %d in the outbox (%d sent, %d unsent: pending the relay, %d of them already in the stream); %d more sent and swept from the outbox (checked in the stream)\n",
		ev.Events, ev.EventsSent, ev.EventsUnsent, ev.PublishedUnmarked, ev.EventsSwept)
	fmt.Fprintf(w, "events per order:  %s\n", histogram(ev.EventsPerOrder))
	fmt.Fprintf(w, "stream %s:     %d messages, %d distinct message ids, %d repeated message ids (published again past the duplicate window; applied once)\n",
		eventStream, ev.StreamMsgs, ev.StreamIDs, ev.Repeats)
	if ev.MaxAge > 0 {
		fmt.Fprintf(w, "stream max age:    %s: %d sent events' messages are past it and gone (their receipts checked)\n", ev.MaxAge, ev.AgedOut)
	}
	fmt.Fprintf(w, "receipts:          %d\n", ev.Receipts)
	fmt.Fprintf(w, "receipts per order: %s (orders whose event is in the stream)\n", histogram(ev.ReceiptsPerOrder))
	fmt.Fprintf(w, "events pending:    %d unsent (the relay), %d in the stream without a receipt (the consumer)\n", ev.EventsUnsent, ev.ReceiptsPending)
	if ev.AckedWithoutReceipt > 0 {
		fmt.Fprintf(w, "events lost:       %d acknowledged by consumer %s without a receipt (violations)\n", ev.AckedWithoutReceipt, receiptsDurable)
	}
}
