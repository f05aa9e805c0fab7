package ordersapp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
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
	auditStreamStall = 2 * time.Minute
	auditFetchBatch  = 1000
	auditFetchWait   = time.Second // how long one fetch waits for its first message
	// auditEndUnknownWait is how long a fetch waits before the end of the
	// read is known.
	auditEndUnknownWait = 50 * time.Millisecond
	auditResetAttempts  = 12 // tries to make the ordered consumer of one fetch, 1s to 10s apart
	auditNoLeaderWait   = 30 * time.Second
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
// first (see eachStreamMsg). exists is false when there is no such
// stream; maxAge is the stream's maximum age (0: none).
func readStream(ctx context.Context, js jetstream.JetStream, read *atomic.Int64) (msgs []streamMsg, exists bool, maxAge time.Duration, err error) {
	return readStreamFetching(ctx, js, read, nil)
}

// readStreamFetching is readStream, calling beforeFetch (tests only) before
// each fetch.
func readStreamFetching(ctx context.Context, js jetstream.JetStream, read *atomic.Int64, beforeFetch func()) (msgs []streamMsg, exists bool, maxAge time.Duration, err error) {
	sr, err := openStreamRead(ctx, js, time.Time{})
	if err != nil || !sr.exists {
		return nil, sr.exists, 0, err
	}
	sr.beforeFetch = beforeFetch
	if err := sr.stopAtLast(ctx); err != nil {
		return nil, true, 0, err
	}
	err = sr.each(ctx, read, func(m streamMsg) error {
		msgs = append(msgs, m)
		return nil
	})
	if err != nil {
		return nil, true, 0, err
	}
	return msgs, true, sr.maxAge, nil
}

// streamRead reads the orders.created messages of stream ORDERS stored at
// or after from (every one when from is zero), oldest first, through an
// ordered consumer. It may start before it knows where to stop: the audit
// starts it first, beside the database's reads, and once the outbox is
// read tells it to stop at the last message stored then (stopAtLast).
type streamRead struct {
	st     jetstream.Stream
	cons   jetstream.Consumer
	from   time.Time
	exists bool          // false: there is no stream ORDERS
	maxAge time.Duration // the stream's maximum age (0: none)
	// last is the sequence to read up to, set once by stopAtLast (0:
	// nothing to read); stop is closed then.
	last uint64
	stop chan struct{}

	beforeFetch func() // tests only: called before each fetch
}

// openStreamRead finds stream ORDERS and makes the ordered consumer.
func openStreamRead(ctx context.Context, js jetstream.JetStream, from time.Time) (*streamRead, error) {
	sr := &streamRead{from: from, stop: make(chan struct{})}
	callCtx, cancel := context.WithTimeout(ctx, auditStreamStall)
	defer cancel()
	st, err := whileNoResponders(callCtx, auditNoLeaderWait, func() (jetstream.Stream, error) { return js.Stream(callCtx, eventStream) })
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return sr, nil
	}
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", eventStream, err)
	}
	sr.st, sr.exists, sr.maxAge = st, true, st.CachedInfo().Config.MaxAge
	// Each fetch of an ordered consumer makes its server-side consumer
	// again, retrying with a backoff (1s doubling to 10s) as often as
	// MaxResetAttempts allows: left at zero, for ever, whatever ctx says
	// (nats-server 2.9 refuses new consumers of a replicated stream for
	// about a minute after one of its servers dies, and the audit hung).
	// Making it the first time is not retried by the client: a consumer
	// is made by the stream's leader, and a cluster electing one has no
	// responder.
	cfg := jetstream.OrderedConsumerConfig{FilterSubjects: []string{eventSubject}, DeliverPolicy: jetstream.DeliverAllPolicy,
		MaxResetAttempts: auditResetAttempts}
	if !from.IsZero() {
		cfg.DeliverPolicy, cfg.OptStartTime = jetstream.DeliverByStartTimePolicy, &from
	}
	sr.cons, err = whileNoResponders(callCtx, auditNoLeaderWait, func() (jetstream.Consumer, error) {
		return st.OrderedConsumer(callCtx, cfg)
	})
	if err != nil {
		return nil, fmt.Errorf("reading stream %s: %w", eventStream, err)
	}
	return sr, nil
}

// stopAtLast tells the read to stop at the last orders.created message
// stored now: the last message there is, not the stream's last sequence
// (a message deleted by hand, or by a limit, leaves that sequence behind
// with nothing at it, and the read would wait for it until it stalls).
// Call it once, and only when the stream exists.
func (sr *streamRead) stopAtLast(ctx context.Context) error {
	callCtx, cancel := context.WithTimeout(ctx, auditStreamStall)
	defer cancel()
	lastMsg, err := whileNoResponders(callCtx, auditNoLeaderWait, func() (*jetstream.RawStreamMsg, error) {
		return sr.st.GetLastMsgForSubject(callCtx, eventSubject)
	})
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
	case err != nil:
		return fmt.Errorf("stream %s: %w", eventStream, err)
	case !sr.from.IsZero() && lastMsg.Time.Before(sr.from):
		// Nothing stored since from.
	default:
		sr.last = lastMsg.Sequence
	}
	close(sr.stop)
	return nil
}

// each calls fn with each message, adding each to read, until the one at
// the sequence stopAtLast set (and the rest of its fetch). A fetch that
// comes back empty before then does not end the read: on a loaded machine
// or a slow link a fetch can wait out its time before its first message
// arrives, and the next one starts again after the last message received.
// The read has no deadline of its own, since a stream of millions of
// messages takes minutes: once it knows where to stop, it ends with an
// error when auditStreamStall passes without a message.
func (sr *streamRead) each(ctx context.Context, read *atomic.Int64, fn func(streamMsg) error) error {
	if !sr.exists {
		return nil
	}
	var lastProgress, stopKnown time.Time
	n, seen := 0, uint64(0) // messages read, the highest sequence read
	for {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("reading stream %s: %w", eventStream, err)
		}
		select {
		case <-sr.stop:
			if seen >= sr.last { // sr.last 0: nothing to read
				return nil
			}
			if stopKnown.IsZero() {
				stopKnown = time.Now()
			}
			if lastProgress.Before(stopKnown) {
				lastProgress = stopKnown
			}
			if time.Since(lastProgress) > auditStreamStall {
				return fmt.Errorf("reading stream %s: no message for %s after %d, up to sequence %d", eventStream, auditStreamStall, n, sr.last)
			}
		default:
		}
		if sr.beforeFetch != nil {
			sr.beforeFetch()
		}
		// Before the end is known, each fetch waits briefly, so that the
		// read sees the end soon after it is set (a fetch ends early only
		// when its batch fills). Once it is known, a fetch asks for no more
		// than the messages left, so that the last one ends as soon as they
		// came instead of waiting out its time: small audits took 0.9 s
		// more for that.
		batchSize, wait := auditFetchBatch, auditFetchWait
		select {
		case <-sr.stop:
			if left := sr.last - seen; left < uint64(batchSize) {
				batchSize = int(left)
			}
		default:
			wait = auditEndUnknownWait
		}
		batch, err := sr.cons.Fetch(batchSize, jetstream.FetchMaxWait(wait))
		if err != nil {
			return fmt.Errorf("reading stream %s: %w", eventStream, err)
		}
		got, seq := 0, uint64(0)
		for m := range batch.Messages() {
			got++
			md, err := m.Metadata()
			if err != nil {
				return fmt.Errorf("reading stream %s: %w", eventStream, err)
			}
			read.Add(1)
			seq = md.Sequence.Stream
			if err := fn(streamMsg{seq: seq, id: m.Headers().Get(jetstream.MsgIDHeader), body: m.Data()}); err != nil {
				return err
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) {
			return fmt.Errorf("reading stream %s: %w", eventStream, err)
		}
		if got > 0 {
			n, seen = n+got, max(seen, seq)
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

// readOutbox reads the orders' events in the outbox into their sort;
// merge judges them with the stream's messages and the receipts
// (invariants 5 and 6).
func (a *auditPass) readOutbox(ctx context.Context, be *backend) error {
	ev := &a.rep.events
	ev.checked = true
	ev.EventsPerOrder, ev.ReceiptsPerOrder = map[int]int{}, map[int]int{}
	from := a.windowFrom()
	events := a.sorters[srcEvents]
	err := be.outbox.Each(ctx, func(e outbox.Event, sentAt time.Time) error {
		a.read.events.Add(1)
		if e.CreatedAt.Before(from) {
			return nil
		}
		ev.Events++
		sent := !sentAt.IsZero()
		if sent {
			ev.EventsSent++
		} else {
			ev.EventsUnsent++
		}
		return events.add(orderOfEvent(e.ID), e.ID, e.Subject, flagOf(sent), bodyHash(e.Body))
	})
	if err != nil {
		return fmt.Errorf("reading the outbox: %w", err)
	}
	return events.finish()
}

// readEvents ends the read of stream ORDERS, then reads the receipts
// consumer's ack floor, then the receipts, each into its sort. The outbox
// was read before (readOutbox): an event marked sent before the outbox was
// read was published before, so the stream has it.
func (a *auditPass) readEvents(ctx context.Context, be *backend, js jetstream.JetStream) error {
	ev := &a.rep.events
	// The stream has been read since the pass began (startStream): it
	// stops at the last message stored now, while the rest is read.
	if err := a.stream.stopAfterOutbox(ctx); err != nil {
		return err
	}

	// The consumer's ack floor, before the receipts: it acknowledges a
	// message only after its receipt committed (or, on a mismatch,
	// terminates it without one), so every message at or below the floor
	// read here has its receipt among those read next.
	var err error
	if a.ackFloor, err = receiptsAckFloor(ctx, js); err != nil {
		return err
	}

	// The receipts, once the stream's end is set: a receipt of a message
	// after it has its order judged without its message, as unpublished.
	receipts := a.sorters[srcReceipts]
	err = be.receiptsSince(ctx, a.since, func(r orders.Receipt) error {
		a.read.receipts.Add(1)
		ev.Receipts++
		return receipts.add(r.OrderID, r.ID, r.EventID, r.UserID, strconv.FormatInt(r.Total, 10), r.Currency)
	})
	if err != nil {
		return fmt.Errorf("reading receipts: %w", err)
	}

	if err := a.stream.wait(); err != nil {
		return err
	}
	a.streamExists, ev.MaxAge = a.stream.sr.exists, a.stream.sr.maxAge
	for _, seq := range a.noID {
		ev.StreamMsgs++
		a.violate("message %d of stream %s has no Nats-Msg-Id", seq, eventStream)
	}
	if !a.streamExists && ev.EventsSent > 0 {
		// Not one violation per event: the audit reads another NATS than
		// the one the relay published to, or the stream was deleted.
		a.violate("stream %s does not exist on this NATS, but %d events are marked sent: is it the NATS that serve publishes to (--nats-url)?", eventStream, ev.EventsSent)
	}
	return a.sorters[srcMessages].finish()
}

// windowFrom is how far back the outbox and the stream are read: a minute
// before the window (the skew between the database's and NATS' clocks);
// zero without a window.
func (a *auditPass) windowFrom() time.Time {
	if a.since.IsZero() {
		return time.Time{}
	}
	return a.since.Add(-streamAgeMargin)
}

// auditStream is the read of stream ORDERS that runs beside the rest of a
// pass, into the sort srcMessages.
type auditStream struct {
	sr   *streamRead
	done chan struct{}
	err  error
}

// startStream opens the read of stream ORDERS and starts it on its own
// goroutine. It may run beside the database's reads: the stream only
// grows, and where it stops is decided after the outbox is read
// (stopAfterOutbox).
func (a *auditPass) startStream(ctx context.Context, js jetstream.JetStream) error {
	sr, err := openStreamRead(ctx, js, a.windowFrom())
	if err != nil {
		return err
	}
	a.stream = &auditStream{sr: sr, done: make(chan struct{})}
	msgs := a.sorters[srcMessages]
	var seq [8]byte
	go func() {
		defer close(a.stream.done)
		a.stream.err = sr.each(ctx, &a.read.messages, func(m streamMsg) error {
			if m.id == "" {
				a.noID = append(a.noID, m.seq)
				return nil
			}
			binary.BigEndian.PutUint64(seq[:], m.seq)
			return msgs.add(orderOfEvent(m.id), m.id, string(seq[:]), bodyHash(m.body))
		})
	}()
	return nil
}

// stopAfterOutbox tells the stream's read where to stop: an event marked
// sent before the outbox was read was published before, so the stream has
// it by then.
func (s *auditStream) stopAfterOutbox(ctx context.Context) error {
	if !s.sr.exists {
		return nil
	}
	return s.sr.stopAtLast(ctx)
}

// wait waits for the stream's read to end.
func (s *auditStream) wait() error {
	<-s.done
	return s.err
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
