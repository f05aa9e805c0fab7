package ordersapp

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/idemnats"
	"github.com/idem-go/idem/outbox"
)

// relayInterval is how often the relay looks for unsent events when
// nothing kicks it: the backstop for the orders made by the completer and
// by other instances, and for events whose publish failed. An order
// created through this instance's API kicks a pass at once (kickOnCreate).
const relayInterval = time.Second

// relayDrainTimeout bounds the relay's last pass at shutdown.
const relayDrainTimeout = 5 * time.Second

// consumerStopTimeout bounds the wait for the consumer's handler to
// finish the messages it has at shutdown.
const consumerStopTimeout = 10 * time.Second

// events is the order events' side of a process: the outbox relay (serve)
// and the receipts consumer (serve unless --consume=false, and
// `orders consume`), on one NATS connection.
type events struct {
	broker  *broker
	be      *backend
	relay   *outbox.Relay // nil when this process does not relay
	consume bool
	handler jetstream.MessageHandler
	ackWait time.Duration
	// replicas is the count of copies asked of stream ORDERS
	// (--stream-replicas); an existing stream's higher count is kept.
	replicas int
	maxAge   time.Duration // --stream-max-age; 0: the stream's own
	logger   *slog.Logger
	// failed receives the error that stops the events for good (a replica
	// count the NATS servers refuse); the command that started them ends
	// with it.
	failed chan error

	// handled counts the consumer's messages whose receipt function ran
	// to its end (applied, or found applied before); published and
	// relayErrors the relay's work.
	handled     atomic.Int64
	published   prometheus.Counter
	relayErrors prometheus.Counter
	receipts    prometheus.Counter

	stopOnce sync.Once
	cancel   context.CancelFunc
	done     chan struct{} // closed when the loop of start ends
	mu       sync.Mutex    // guards cc, ready
	cc       jetstream.ConsumeContext
	closed   <-chan struct{} // cc.Closed(), taken while cc was valid
	ready    bool            // the stream (and consumer) exist
}

// eventsOptions are newEvents' settings.
type eventsOptions struct {
	relay   bool
	consume bool
	store   idem.Store // the idempotency store of the consumer's idem.Do
	lease   time.Duration
	ackWait time.Duration // 0: consumerAckWait(lease)
	ttl     time.Duration
	// replicas is --stream-replicas; 0: 1 for a new stream, an existing
	// one keeps its count.
	replicas int
	// maxAge is --stream-max-age; 0: a new stream keeps messages for
	// ever, an existing one keeps its own age.
	maxAge time.Duration
	logger *slog.Logger
}

// newEvents builds the relay and the consumer's handler on b; nothing runs
// until start.
func newEvents(b *broker, be *backend, o eventsOptions) *events {
	e := &events{
		broker:   b,
		be:       be,
		consume:  o.consume,
		ackWait:  cmp.Or(o.ackWait, consumerAckWait(o.lease)),
		replicas: o.replicas,
		maxAge:   o.maxAge,
		logger:   o.logger,
		failed:   make(chan error, 1),
		published: prometheus.NewCounter(prometheus.CounterOpts{Name: "orders_events_published_total",
			Help: "orders.created events this instance's outbox relay published to JetStream and marked sent."}),
		relayErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "orders_events_relay_errors_total",
			Help: "Passes of the outbox relay that ended with an error (NATS or the database); the events stay unsent and are tried again."}),
		receipts: prometheus.NewCounter(prometheus.CounterOpts{Name: "orders_receipts_handled_total",
			Help: "orders.created messages whose receipt this instance's consumer wrote, or found written before."}),
	}
	if o.relay {
		e.relay = outbox.NewRelay(be.outbox, idemnats.NewPublisher(b.js), outbox.RelayOptions{
			Interval: relayInterval,
			Logger:   o.logger,
			OnPass: func(sent int, err error) {
				e.published.Add(float64(sent))
				if err != nil && !errors.Is(err, context.Canceled) {
					e.relayErrors.Inc()
				}
			},
		})
	}
	if o.consume {
		e.handler = dropBadEvents(idemnats.Handler(o.store, idemnats.ConsumerOptions{
			User:      receiptsUser,
			Operation: receiptsOp,
			Lease:     o.lease,
			TTL:       o.ttl,
			Logger:    o.logger,
		}, e.counted(receiptFunc(be))), be.repo, o.logger)
	}
	return e
}

// counted wraps the receipt function to count the messages it handled.
func (e *events) counted(fn idem.DoFunc) idem.DoFunc {
	return func(ctx context.Context, input []byte) ([]byte, error) {
		out, err := fn(ctx, input)
		if err == nil {
			e.handled.Add(1)
			e.receipts.Inc()
		}
		return out, err
	}
}

// collectors are the events' metrics.
func (e *events) collectors() []prometheus.Collector {
	return []prometheus.Collector{e.published, e.relayErrors, e.receipts, newBacklogCollector(e)}
}

// backlogCollector exports the backlog of the durable consumer "receipts",
// which every consumer of the fleet shares, as JetStream reports it at each
// scrape: the lag of the receipts behind the orders. Nothing is exported
// while NATS does not answer (within backlogScrapeTimeout) or the consumer
// does not exist yet.
type backlogCollector struct {
	e                   *events
	pending, ackPending *prometheus.Desc
}

// backlogScrapeTimeout bounds the JetStream request of one scrape.
const backlogScrapeTimeout = 500 * time.Millisecond

func newBacklogCollector(e *events) backlogCollector {
	return backlogCollector{
		e: e,
		pending: prometheus.NewDesc("orders_receipts_pending",
			"orders.created messages of stream ORDERS that the receipts consumer (shared by the fleet) has not delivered yet: the receipts' lag behind the events.", nil, nil),
		ackPending: prometheus.NewDesc("orders_receipts_ack_pending",
			"orders.created messages delivered to a receipts consumer and not acknowledged yet (being applied, or waiting for the ack wait to deliver them again).", nil, nil),
	}
}

func (c backlogCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.pending
	ch <- c.ackPending
}

func (c backlogCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), backlogScrapeTimeout)
	defer cancel()
	info, err := c.e.consumerInfo(ctx)
	if err != nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(c.pending, prometheus.GaugeValue, float64(info.NumPending))
	ch <- prometheus.MustNewConstMetric(c.ackPending, prometheus.GaugeValue, float64(info.NumAckPending))
}

// consumerInfo asks JetStream for the durable consumer "receipts".
func (e *events) consumerInfo(ctx context.Context) (*jetstream.ConsumerInfo, error) {
	cons, err := e.broker.js.Consumer(ctx, eventStream, receiptsDurable)
	if err != nil {
		return nil, err
	}
	return cons.Info(ctx)
}

// The receipts consumer's pull requests: each waits up to
// consumerPullExpiry for messages, and the server sends a heartbeat every
// consumerHeartbeat while it does. Two heartbeats missed, the client
// pulls again: that is how long the consumer stalls when the server that
// held its pull request dies (the consumer's leader in a JetStream
// cluster), or a leader change loses the request. With the client's
// defaults (30s, 15s) that was 30s.
const (
	consumerPullExpiry = 10 * time.Second
	consumerHeartbeat  = time.Second
)

// consumerAckWait is the consumer's AckWait: longer than the key lease, so
// that JetStream does not hand a message to a second consumer while the
// first still holds its key (the second would only find it in flight).
func consumerAckWait(lease time.Duration) time.Duration {
	return max(lease+10*time.Second, 30*time.Second)
}

// streamConfig is stream ORDERS with replicas copies (0: 1 for a new
// stream; an existing stream's higher count is kept, and logger says so)
// and maxAge (0: none for a new stream; an existing one keeps its own).
func streamConfig(replicas int, maxAge time.Duration, logger *slog.Logger) idemnats.StreamConfig {
	return idemnats.StreamConfig{Name: eventStream, Subjects: []string{eventSubject}, Duplicates: eventDuplicates, Replicas: replicas, MaxAge: maxAge, Logger: logger}
}

// setup creates or updates stream ORDERS and, when this process consumes,
// the durable consumer "receipts" on it.
func (e *events) setup(ctx context.Context) (jetstream.Consumer, error) {
	st, err := idemnats.EnsureStream(ctx, e.broker.js, streamConfig(e.replicas, e.maxAge, e.logger))
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", eventStream, err)
	}
	if err := e.noteStream(ctx, st); err != nil {
		return nil, fmt.Errorf("recording stream %s in the database: %w", eventStream, err)
	}
	if !e.consume {
		return nil, nil
	}
	cons, err := st.CreateOrUpdateConsumer(ctx, receiptsConsumerConfig(e.ackWait))
	if err != nil {
		return nil, fmt.Errorf("consumer %s on stream %s: %w", receiptsDurable, eventStream, err)
	}
	return cons, nil
}

// receiptsConsumerConfig is the durable consumer every receipts consumer
// shares: it resumes where the last one acknowledged, and redelivers
// without limit what was not acknowledged (a redelivery of an applied
// message is a replay of its key: acknowledged, not applied again).
func receiptsConsumerConfig(ackWait time.Duration) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       receiptsDurable,
		Description:   "orders: one receipt per orders.created event",
		FilterSubject: eventSubject,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       ackWait,
		MaxDeliver:    -1,
	}
}

// start sets up the stream and the consumer (again and again, with a
// growing pause, until NATS answers), then runs the relay and the
// consumer until stop.
func (e *events) start(ctx context.Context) {
	ctx, e.cancel = context.WithCancel(ctx)
	e.done = make(chan struct{})
	go func() {
		defer close(e.done)
		pause := 250 * time.Millisecond
		var cons jetstream.Consumer
		for {
			sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			c, err := e.setup(sctx)
			cancel()
			if err == nil {
				cons = c
				break
			}
			if ctx.Err() != nil {
				return
			}
			if idemnats.ReplicasRefused(err) {
				// No retry makes the servers hold more copies than they
				// can: the operator has to change one or the other.
				e.failed <- replicasError(e.broker, e.replicas, err)
				return
			}
			e.logger.Warn("orders: NATS not ready; events wait in the outbox", "nats", e.broker.name, "err", err, "retry_in", pause)
			select {
			case <-ctx.Done():
				return
			case <-time.After(pause): // backoff before the next try, not a wait for an outcome
			}
			pause = min(2*pause, 5*time.Second)
		}
		if cons != nil {
			cc, err := cons.Consume(e.handler, jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
				if ctx.Err() == nil {
					e.logger.Warn("orders: receipts consumer", "err", err)
				}
			}), jetstream.PullExpiry(consumerPullExpiry), jetstream.PullHeartbeat(consumerHeartbeat))
			if err != nil {
				e.logger.Error("orders: starting the receipts consumer", "err", err)
			} else {
				e.mu.Lock()
				// Closed is taken now: once the subscription is closed it
				// returns a closed channel even while the handler runs.
				e.cc, e.closed = cc, cc.Closed()
				e.mu.Unlock()
			}
		}
		e.mu.Lock()
		e.ready = true
		e.mu.Unlock()
		if e.relay != nil {
			e.relay.Run(ctx)
		} else {
			<-ctx.Done()
		}
	}()
}

// stop ends the relay after one last pass (bounded), then stops the
// consumer once the messages it holds are handled (bounded). The
// connection stays open: the broker's close closes it.
func (e *events) stop() {
	e.stopOnce.Do(func() {
		if e.cancel == nil {
			return
		}
		e.cancel()
		<-e.done
		e.mu.Lock()
		ready, cc, closed := e.ready, e.cc, e.closed
		e.mu.Unlock()
		if ready && e.relay != nil {
			ctx, cancel := context.WithTimeout(context.Background(), relayDrainTimeout)
			if n, err := e.relay.RunOnce(ctx); err != nil {
				e.logger.Warn("orders: the relay's last pass", "sent", n, "err", err)
			}
			cancel()
		}
		if cc != nil {
			// Drain: the messages fetched are handled, then it closes.
			cc.Drain()
			select {
			case <-closed:
			case <-time.After(consumerStopTimeout):
				cc.Stop()
				select {
				case <-closed:
				case <-time.After(consumerStopTimeout):
				}
				e.logger.Warn("orders: the receipts consumer did not finish its messages in time; the server redelivers the rest after the ack wait")
			}
		}
	})
}

// kick asks the relay for a pass now.
func (e *events) kick() {
	if e != nil && e.relay != nil {
		e.relay.Kick()
	}
}

// eventCheckTimeout bounds the consumer's look at the database for the
// order of one message (dropBadEvents).
const eventCheckTimeout = 10 * time.Second

// dropBadEvents terminates (never redelivers) a message, before its id is
// claimed, when no retry would make it an event to apply: its body is no
// orders.created event (orders.DecodeCreated), or no order of the database
// backs it (orders.CheckEventOrder: no such order for its user, or another
// total or currency). The order commits before its event is published, so
// a missing order is never one still on its way: the message was not
// published by the service (a forged or edited event), and writing its
// receipt would vouch for an order that does not exist. It logs an error
// naming the message's event id. When the database cannot tell (it does
// not answer), the message is negatively acknowledged and comes again.
// Any other message goes to h.
func dropBadEvents(h jetstream.MessageHandler, g orders.OrderGetter, logger *slog.Logger) jetstream.MessageHandler {
	term := func(m jetstream.Msg) {
		if err := m.Term(); err != nil {
			logger.Warn("orders: term failed; the server redelivers after the ack wait", "err", err)
		}
	}
	return func(m jetstream.Msg) {
		eventID := m.Headers().Get(jetstream.MsgIDHeader)
		ev, err := orders.DecodeCreated(m.Data())
		if err != nil {
			logger.Error("orders: a message of stream ORDERS that is no orders.created event; terminated",
				"subject", m.Subject(), "msg_id", eventID, "err", err)
			term(m)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), eventCheckTimeout)
		err = orders.CheckEventOrder(ctx, g, ev)
		cancel()
		switch {
		case errors.Is(err, orders.ErrUnknownOrder):
			logger.Error("orders: an orders.created event that no order of the database backs (not published by the service); terminated, no receipt written",
				"event_id", eventID, "order_id", ev.ID, "user", ev.UserID, "total", ev.Total, "currency", ev.Currency, "err", err)
			term(m)
			return
		case err != nil:
			logger.Warn("orders: looking up the order of an event failed; redelivered after the nak delay",
				"event_id", eventID, "order_id", ev.ID, "delay", idemnats.DefaultNakDelay, "err", err)
			if err := m.NakWithDelay(idemnats.DefaultNakDelay); err != nil {
				logger.Warn("orders: nak failed; the server redelivers after the ack wait", "err", err)
			}
			return
		}
		h(m)
	}
}

// kickOnCreate calls kick after each POST /v1/orders has been answered:
// by then its transaction, and the event in it, has committed (or not).
// Kicks coalesce; a pass that finds nothing costs one query.
func kickOnCreate(h http.Handler, kick func()) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(w, r)
		if r.Method == http.MethodPost && r.URL.Path == "/v1/orders" {
			kick()
		}
	})
}

// receiptFunc is the consumer's operation "orders.receipt": it applies
// one orders.created body (orders.ApplyCreated) in the idem.Do
// transaction, and answers the receipt's ids. A body that is no such event
// fails with an error matching orders.ErrBadEvent: no retry helps, and the
// consumer terminates the message.
func receiptFunc(be *backend) idem.DoFunc {
	return func(ctx context.Context, body []byte) ([]byte, error) {
		r, err := orders.ApplyCreated(ctx, be.receipts, body)
		if err != nil {
			return nil, err
		}
		return json.Marshal(struct {
			Receipt string `json:"receipt_id"`
			Order   string `json:"order_id"`
		}{r.ID, r.OrderID})
	}
}
