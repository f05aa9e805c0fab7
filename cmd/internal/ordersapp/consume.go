package ordersapp

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/cli"
)

// consumeProgressEvery is how often `orders consume` prints its progress.
const consumeProgressEvery = 5 * time.Second

func (a *App) consume(ctx context.Context, args []string) error {
	var c Config
	fs := cli.NewFlagSet("orders consume", "Runs the receipts consumer alone, until SIGINT or SIGTERM: the durable consumer \"receipts\" of stream ORDERS, "+
		"which applies each orders.created event once (one receipt per order, written in the same transaction as the claim of the message id; "+
		"acknowledged after the commit), and a completer for the receipts whose consumer died holding their key. Several may run at once, "+
		"with serve's own (serve --consume): they share the durable consumer. Prints its progress to stderr every 5s.", a.Getenv)
	c.storageFlags(fs)
	c.natsFlag(fs, "NATS server with JetStream: nats://host:port or tls://host:port, several comma-separated for a cluster "+
		"(default: the embedded server of the orders serve running on --data-dir, found through <data-dir>/nats.url; when none runs, one started by this process on <data-dir>/nats)")
	fs.Duration(&c.KeyLease, "key-lease", "ORDERS_KEY_LEASE", 30*time.Second, "how long one delivery holds its message id; after it a redelivery or the completer takes over")
	fs.Duration(&c.KeyTTL, "key-ttl", "ORDERS_KEY_TTL", 24*time.Hour, "how long a message id is remembered after its receipt; a repeat delivered later (stream ORDERS keeps its messages for ever) runs the receipt function again, which finds the order's receipt and writes none")
	c.ackWaitFlag(fs)
	c.streamReplicasFlag(fs)
	c.streamMaxAgeFlag(fs)
	if err := a.parse(fs, args); err != nil {
		return err
	}
	if c.KeyLease <= 0 {
		return cli.Usagef("orders consume: --key-lease must be positive")
	}
	if c.KeyTTL <= c.KeyLease {
		return cli.Usagef("orders consume: --key-ttl %v is not longer than --key-lease %v", c.KeyTTL, c.KeyLease)
	}
	if err := c.checkAckWait("orders consume: "); err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(a.Stderr, nil))
	be, err := openBackend(ctx, &c)
	if err != nil {
		return err
	}
	defer be.close()
	b, err := openBroker(ctx, &c, brokerOptions{mode: brokerJoin, client: "orders consume", publishURL: true, waitConnect: true, logger: logger})
	if err != nil {
		return err
	}
	defer b.close()
	if c.NATSURL == "" {
		if err := checkEmbeddedStream(ctx, be, b, c.StreamReplicas, c.StreamMaxAge, logger); err != nil {
			return err
		}
	}
	ev := newEvents(b, be, eventsOptions{consume: true, store: be.store, lease: c.KeyLease, ackWait: c.AckWait, ttl: c.KeyTTL, replicas: c.StreamReplicas, maxAge: c.StreamMaxAge, logger: logger})
	completer := idem.NewCompleter(be.store, nil, idem.CompleterOptions{
		Interval: completerInterval,
		Logger:   logger,
		Funcs:    map[string]idem.DoFunc{receiptsOp: receiptFunc(be)},
	})
	logger.Info("orders consume: running", "database", be.name, "nats", b.name)

	bg, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); completer.Run(bg) }()
	ev.start(bg)
	tick := time.NewTicker(consumeProgressEvery)
	defer tick.Stop()
	var failed error
	for done := false; !done; {
		select {
		case <-ctx.Done():
			done = true
		case failed = <-ev.failed:
			logger.Error("orders consume: stopping: the order events cannot run", "err", failed)
			done = true
		case <-tick.C:
			fmt.Fprintf(a.Stderr, "orders consume: %d events applied by this process (receipts written or found written)%s\n", ev.handled.Load(), ev.backlog(ctx))
		}
	}
	ev.stop()
	stop()
	wg.Wait()
	fmt.Fprintf(a.Stderr, "orders consume: stopped; %d events applied by this process\n", ev.handled.Load())
	return failed
}

// backlog describes the consumer's backlog for a progress line: ", N
// waiting, M delivered and not acknowledged", or "" when NATS does not
// tell.
func (e *events) backlog(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	info, err := e.consumerInfo(ctx)
	if err != nil {
		return ""
	}
	return fmt.Sprintf("; consumer %s: %d waiting, %d delivered and not acknowledged", receiptsDurable, info.NumPending, info.NumAckPending)
}
