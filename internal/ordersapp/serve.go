package ordersapp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/checkout"
	"github.com/idem-go/idem/internal/cli"
	"github.com/idem-go/idem/internal/orders"
	"github.com/idem-go/idem/internal/payments"
)

func (a *App) serve(ctx context.Context, args []string) error {
	var c Config
	fs := cli.NewFlagSet("orders serve", "Runs the order API. The schema is migrated first; several instances may start at once. "+serveLimits, a.Getenv)
	c.serveFlags(fs)
	if err := a.parse(fs, args); err != nil {
		return err
	}
	if err := c.validate(); err != nil {
		return err
	}
	logger := slog.New(slog.NewTextHandler(a.Stderr, nil))
	srv, err := a.newServer(ctx, &c, logger)
	if err != nil {
		return err
	}
	defer srv.close()

	ln, err := net.Listen("tcp", c.Addr)
	if err != nil {
		return err
	}
	if c.MetricsAddr != "" {
		mln, err := net.Listen("tcp", c.MetricsAddr)
		if err != nil {
			ln.Close()
			return err
		}
		logger.Info("orders: metrics listening", "url", "http://"+mln.Addr().String()+"/metrics")
		ms := newHTTPServer(srv.metricsHandler)
		go ms.Serve(mln)
		defer ms.Close()
	}
	logger.Info("orders: listening", "url", "http://"+ln.Addr().String(), "database", srv.backend.name, "payments", srv.paymentsName)
	return srv.run(ctx, ln)
}

// Bounds on what a client may make the server wait for or hold: fixed,
// and the same for the API and --metrics-addr (issue 10, point 6).
const (
	// serveReadHeaderTimeout: a request's headers must arrive within it
	// (a slowloris sending one byte a second is cut).
	serveReadHeaderTimeout = 10 * time.Second
	// serveReadTimeout: the whole request, headers and body, must arrive
	// within it; a client that sends part of a body and stops is cut.
	// The middleware reads the whole body before it claims the key, so
	// such a request never claims it. It bounds reading only: a handler
	// still working after it (a slow payment) is not cut, and its answer
	// is written.
	serveReadTimeout = 30 * time.Second
	// serveIdleTimeout: an idle keep-alive connection is closed after it.
	serveIdleTimeout = 2 * time.Minute
	// serveMaxHeaderBytes bounds the request line and headers; a request
	// over it is answered 431.
	serveMaxHeaderBytes = 64 << 10
)

// serveLimits says the bounds above in --help.
const serveLimits = "Slow or greedy clients are cut: headers must arrive within 10s and the whole request within 30s (a handler may run longer), request headers are bounded to 64 KiB (431 over it), idle connections close after 2m."

// newHTTPServer returns an http.Server for h with the bounds above and no
// write deadline (which would cut a slow handler's answer).
func newHTTPServer(h http.Handler) *http.Server {
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: serveReadHeaderTimeout,
		ReadTimeout:       serveReadTimeout,
		IdleTimeout:       serveIdleTimeout,
		MaxHeaderBytes:    serveMaxHeaderBytes,
	}
}

// server is a running order service: HTTP handler, storage and the
// background cleaner.
type server struct {
	backend        *backend
	handler        http.Handler
	metricsHandler http.Handler    // GET /metrics alone, for --metrics-addr
	ledger         payments.Ledger // the in-process gateway's, nil when external
	payer          payer
	paymentsName   string
	logger         *slog.Logger
	metrics        *idem.Metrics
	ordersCfg      orders.Config
	completer      *idem.Completer
}

// completerInterval is how often serve looks for abandoned requests.
const completerInterval = 2 * time.Second

func (a *App) newServer(ctx context.Context, c *Config, logger *slog.Logger) (*server, error) {
	secret, err := c.secret()
	if err != nil {
		return nil, fmt.Errorf("JWT secret: %w", err)
	}
	be, err := openBackend(ctx, c)
	if err != nil {
		return nil, err
	}
	p, ledger, err := newPayer(ctx, c, be)
	if err != nil {
		be.close()
		return nil, err
	}
	var extra func(io.Writer)
	if c.RedisURL != "" {
		fs, rdb, err := withRedis(ctx, be, c.RedisURL)
		if err != nil {
			be.close()
			return nil, err
		}
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		if err := rdb.Ping(pctx).Err(); err != nil {
			logger.Warn("orders: Redis does not answer; serving from the database alone until it does", "err", err)
		}
		cancel()
		extra = func(w io.Writer) { writeRedisMetrics(w, fs.Metrics()) }
	}
	s := &server{backend: be, logger: logger, metrics: new(idem.Metrics), paymentsName: c.PaymentsURL, ledger: ledger, payer: p}
	if ledger != nil {
		s.paymentsName = "in-process"
	}
	s.ordersCfg = orders.Config{
		Repo:  be.repo,
		Payer: p,
		Idem:  be.store,
		IdemOptions: idem.Options{
			TTL:          c.KeyTTL,
			Lease:        c.KeyLease,
			InFlightWait: c.InFlightWait,
			OptionalKey:  !c.RequireKey,
			// The completer's middleware must keep every order's answer too,
			// and store the same final outcomes (422 order-not-writable).
			MaxStoredBody: orders.MaxStoredResponse,
			Stored:        orders.StoredStatus,
			Metrics:       s.metrics,
			Logger:        logger,
		},
		Secret:       secret,
		Logger:       logger,
		Metrics:      new(orders.Metrics), // shared by the API and the completer
		ExtraMetrics: extra,
		// How long the gateway keeps payment keys, which bounds the age of
		// an operation that pays with its key when the lookup of its
		// payment fails.
		PaymentKeyRetention: paymentKeyRetention(c),
		// An attempt that outlives its lease is fenced at commit; the default
		// payment timeout (20s) stays below the default lease (30s).
	}
	s.ordersCfg.MetricsElsewhere = c.MetricsAddr != ""
	s.ordersCfg.Now = c.testClock // nil outside tests: time.Now
	s.ordersCfg.Page = checkout.Handler(checkout.Options{Secret: secret, Now: c.testClock})
	s.handler = orders.NewHandler(s.ordersCfg)
	s.metricsHandler = orders.MetricsHandler(s.ordersCfg)
	s.completer, err = idem.NewCompleter(be.store, orders.NewCreateHandler(s.ordersCfg), idem.CompleterOptions{
		Interval:   completerInterval,
		Middleware: s.ordersCfg.IdemOptions,
		Logger:     logger,
	})
	if err != nil {
		be.close()
		return nil, err
	}
	return s, nil
}

// paymentKeyRetention is how long the payment gateway surely keeps an
// idempotency key, whatever --key-ttl was when the key was used: an
// external gateway's externalKeyRetention, and for the in-process gateway
// the floor of gatewayKeyRetention. Not gatewayKeyRetention(c) itself: a
// key used before --key-ttl was raised keeps the retention it was given
// then, and a retry that trusted the new one would pay again.
func paymentKeyRetention(c *Config) time.Duration {
	if c.PaymentsURL != "" {
		return externalKeyRetention
	}
	return payments.DefaultKeyRetention
}

func (s *server) close() { s.backend.close() }

// run serves on ln until ctx is done, then shuts down gracefully.
func (s *server) run(ctx context.Context, ln net.Listener) error {
	hs := newHTTPServer(s.handler)
	// The cleaner and the completer stop, and are waited for, before the
	// database is closed.
	bg, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer stop()
	wg.Add(2)
	go func() { defer wg.Done(); s.cleanLoop(bg, time.Minute) }()
	go func() { defer wg.Done(); s.completer.Run(bg) }()

	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	s.logger.Info("orders: shutting down")
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		return err
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// Batches of the background cleaner.
const (
	cleanBatch = 1000
	cleanPause = 10 * time.Millisecond
)

// cleanLoop deletes expired keys at start and then every interval: the
// order store's, then the in-process gateway's (an external gateway
// forgets its own), in the same batches.
func (s *server) cleanLoop(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		s.clean(ctx, "orders: cleaner deleted expired keys", s.backend.sweepKeys)
		if s.payer.gw != nil {
			s.clean(ctx, "orders: cleaner deleted the in-process gateway's expired keys", func(ctx context.Context, batch int, pause time.Duration, progress func(int)) (int, error) {
				return sweepExpired(ctx, s.payer.deleteExpiredGatewayKeys, batch, pause, progress)
			})
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// clean runs one sweep and logs what it did.
func (s *server) clean(ctx context.Context, done string, sweep func(ctx context.Context, batch int, pause time.Duration, progress func(int)) (int, error)) {
	n, err := sweep(ctx, cleanBatch, cleanPause, nil)
	if err != nil && ctx.Err() == nil {
		s.logger.Warn("orders: cleaner", "err", err)
	} else if n > 0 {
		s.logger.Info(done, "count", n)
	}
}

// sweepExpired deletes expired keys with del in batches of batch, pausing
// between batches, until none is left; progress, when set, sees the
// running total.
func sweepExpired(ctx context.Context, del func(ctx context.Context, limit int) (int, error), batch int, pause time.Duration, progress func(total int)) (int, error) {
	total := 0
	for {
		n, err := del(ctx, batch)
		total += n
		if err != nil {
			return total, err
		}
		if progress != nil && n > 0 {
			progress(total)
		}
		if n < batch {
			return total, nil
		}
		select {
		case <-ctx.Done():
			return total, ctx.Err()
		case <-time.After(pause):
		}
	}
}
