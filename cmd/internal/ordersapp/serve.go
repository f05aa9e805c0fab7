package ordersapp

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	neturl "net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/checkout"
	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/idemotel"
	"github.com/idem-go/idem/idemprom"
	"github.com/idem-go/idem/outbox"
)

func (a *App) serve(ctx context.Context, args []string) error {
	var c Config
	fs := cli.NewFlagSet("orders serve", "Runs the order API. The schema is migrated first; several instances may start at once. "+serveRPC+" "+serveEvents+" "+serveLimits+" "+serveObservability, a.Getenv)
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

// serveRPC says in --help that the address serves CreateOrder over RPC.
const serveRPC = "The same address serves POST /orders.v1.OrderService/CreateOrder over gRPC (unencrypted HTTP/2), Connect and gRPC-Web, " +
	"with the HTTP API's bearer token and idempotency keys: a key used over HTTP replays over gRPC, and the reverse."

// serveEvents says in --help what becomes of an order's event.
const serveEvents = "Each order's orders.created event is written with the order (a transactional outbox) and published to NATS JetStream, stream ORDERS, " +
	"by a relay that runs in every instance (NATS may be down: the events wait); the receipts consumer, which applies each event once, runs in this process unless --consume=false."

// serveLimits says the bounds above in --help.
const serveLimits = "Slow or greedy clients are cut: headers must arrive within 10s and the whole request within 30s (a handler may run longer), request headers are bounded to 64 KiB (431 over it), idle connections close after 2m."

// serveObservability says in --help what the service exports.
const serveObservability = "GET /metrics serves Prometheus metrics (on --metrics-addr alone when it is set). " +
	"Traces are exported over OTLP/HTTP (http/protobuf) when OTEL_EXPORTER_OTLP_ENDPOINT (the collector's base URL, /v1/traces appended) " +
	"or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (the full URL) is set, unless OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none; " +
	"OTEL_SERVICE_NAME names the service (default orders); unset, no trace is made. Log lines of a traced request carry its trace_id and span_id."

// newHTTPServer returns an http.Server for h with the bounds above and no
// write deadline (which would cut a slow handler's answer). It speaks
// HTTP/1.1 and, to a client that starts with HTTP/2's preface (prior
// knowledge, as gRPC clients do without TLS), unencrypted HTTP/2: gRPC
// needs it for orders.v1.OrderService, which is served on the API's own
// address.
func newHTTPServer(h http.Handler) *http.Server {
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: serveReadHeaderTimeout,
		ReadTimeout:       serveReadTimeout,
		IdleTimeout:       serveIdleTimeout,
		MaxHeaderBytes:    serveMaxHeaderBytes,
		Protocols:         &protocols,
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
	// cleaners delete expired keys at start and then every cleanInterval.
	cleaners []*idem.Cleaner
	// outboxRetention and outboxSweepEvery: see sweepOutbox.
	outboxRetention, outboxSweepEvery time.Duration
	// registry is what GET /metrics serves.
	registry *prometheus.Registry
	// cleaned and cleanErrors count the cleaner's work, by store
	// ("orders": the API's keys, "gateway": the in-process gateway's).
	cleaned, cleanErrors *prometheus.CounterVec
	// tracer exports spans over OTLP/HTTP; nil when none is configured.
	tracer *sdktrace.TracerProvider
	// broker is the NATS connection (and the embedded server, by default);
	// events the outbox relay and the receipts consumer on it.
	broker *broker
	events *events
}

// completerInterval is how often serve looks for abandoned requests.
const completerInterval = 2 * time.Second

func (a *App) newServer(ctx context.Context, c *Config, logger *slog.Logger) (*server, error) {
	// Without --jwt-secret, instances on one PostgreSQL database share the
	// secret kept in it (read once the schema is migrated); otherwise it is
	// --jwt-secret or the data dir's.
	var secret []byte
	var err error
	if !c.secretInDatabase() {
		if secret, err = c.secret(); err != nil {
			return nil, fmt.Errorf("JWT secret: %w", err)
		}
	}
	be, err := openBackend(ctx, c)
	if err != nil {
		return nil, err
	}
	if secret == nil {
		if be.pg == nil {
			be.close()
			return nil, errors.New("JWT secret: no PostgreSQL pool to read it from")
		}
		if secret, err = c.sharedSecret(ctx, be.pg, logger); err != nil {
			be.close()
			return nil, fmt.Errorf("JWT secret: %w", err)
		}
	}
	p, ledger, err := newPayer(ctx, c, be)
	if err != nil {
		be.close()
		return nil, err
	}
	// Log records carry the trace and span ids of their context.
	logger = slog.New(idemotel.LogHandler(logger.Handler()))
	for _, n := range be.notes {
		logger.Warn("orders: " + n)
	}
	s := &server{backend: be, logger: logger, metrics: new(idem.Metrics), paymentsName: redactURL(c.PaymentsURL), ledger: ledger, payer: p,
		outboxRetention: c.OutboxRetention, outboxSweepEvery: cmp.Or(c.outboxSweepEvery, outboxSweepInterval)}
	if ledger != nil {
		s.paymentsName = "in-process"
	}

	// GET /metrics: the order handler's and the middleware's counters,
	// the store's latency, the completer's and the cleaner's work, the
	// Redis fast path's counters, the Go runtime and the process.
	s.registry = prometheus.NewRegistry()
	storeMetrics, completerMetrics := idemprom.NewStoreMetrics(), idemprom.NewCompleterMetrics()
	s.cleaned = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "orders_cleaner_deleted_total",
		Help: "Expired idempotency keys the cleaner deleted, by store: orders (the API's keys) or gateway (the in-process gateway's)."}, []string{"store"})
	s.cleanErrors = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "orders_cleaner_errors_total",
		Help: "Sweeps of the cleaner that failed, by store."}, []string{"store"})
	for _, st := range []string{cleanOrders, cleanGateway} {
		s.cleaned.WithLabelValues(st)
		s.cleanErrors.WithLabelValues(st)
	}
	ordersMetrics := new(orders.Metrics) // shared by the API and the completer
	s.registry.MustRegister(ordersMetrics, idemprom.NewCollector(s.metrics), storeMetrics, completerMetrics, s.cleaned, s.cleanErrors,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

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
		s.registry.MustRegister(redisCollector{fs.Metrics()})
	}

	// Store calls are timed, and traced when a collector is configured:
	// the wrappers keep the transactions reachable (pgstore.FromContext
	// and sqlitestore.FromContext unwrap them) and the Sweeper.
	store := storeMetrics.Wrap(be.store)
	getenv := a.Getenv
	if getenv == nil {
		getenv = os.Getenv
	}
	s.tracer, err = newTracerProvider(ctx, getenv)
	if err != nil {
		be.close()
		return nil, err
	}
	if s.tracer != nil {
		store = idemotel.WrapStore(store, idemotel.Options{TracerProvider: s.tracer})
	}
	// The wrappers keep the Sweeper of the store they wrap.
	swept, ok := store.(idemdriver.SweepingStore)
	if !ok {
		s.close()
		return nil, fmt.Errorf("the idempotency store %T cannot list abandoned keys or delete expired ones", store)
	}
	be.sweeper = swept

	s.ordersCfg = orders.Config{
		Repo:  be.repo,
		Payer: p,
		Idem:  store,
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
		Secret:   secret,
		Logger:   logger,
		Metrics:  ordersMetrics,
		Gatherer: s.registry,
		// How long the gateway keeps payment keys, which bounds the age of
		// an operation that pays with its key when the lookup of its
		// payment fails.
		PaymentKeyRetention: paymentKeyRetention(c),
		// An attempt that outlives its lease is fenced at commit; the default
		// payment timeout (20s) stays below the default lease (30s).
	}
	s.ordersCfg.MetricsElsewhere = c.MetricsAddr != ""
	s.ordersCfg.Now = c.testClock // nil outside tests: time.Now
	s.ordersCfg.GuestCheckout = c.GuestCheckout
	s.ordersCfg.UserRateEvery, s.ordersCfg.UserRateBurst = -1, 0
	if c.UserRate > 0 {
		s.ordersCfg.UserRateEvery = time.Duration(float64(time.Second) / c.UserRate)
		s.ordersCfg.UserRateBurst = max(1, int(2*c.UserRate))
	}
	s.ordersCfg.MaxLiveKeys = -1
	if c.MaxKeysPerUser > 0 {
		s.ordersCfg.MaxLiveKeys = c.MaxKeysPerUser
	}
	s.ordersCfg.Page = checkout.Handler(checkout.Options{Secret: secret, Now: c.testClock, Guest: c.GuestCheckout})
	if s.tracer != nil {
		s.ordersCfg.TracerProvider = s.tracer
		s.ordersCfg.Propagator = propagation.TraceContext{}
	}
	// The order events: NATS (embedded unless --nats-url), the relay, and
	// the receipts consumer unless --consume=false.
	s.broker, err = openBroker(ctx, c, brokerOptions{mode: brokerOwn, client: "orders serve", publishURL: true, waitConnect: true, logger: logger})
	if err != nil {
		s.close()
		return nil, err
	}
	if c.NATSURL == "" {
		if err := checkEmbeddedStream(ctx, be, s.broker, c.StreamReplicas, c.StreamMaxAge, logger); err != nil {
			s.close()
			return nil, err
		}
	}
	logger.Info("orders: NATS", "nats", s.broker.name, "consume", c.Consume)
	s.events = newEvents(s.broker, be, eventsOptions{relay: true, consume: c.Consume, store: store, lease: c.KeyLease, ackWait: c.AckWait, ttl: c.KeyTTL, replicas: c.StreamReplicas, maxAge: c.StreamMaxAge, logger: logger})
	s.registry.MustRegister(s.events.collectors()...)
	var funcs map[string]idem.DoFunc
	if c.Consume {
		// The completer finishes a receipt whose consumer died holding its
		// key, as JetStream's redelivery would.
		funcs = map[string]idem.DoFunc{receiptsOp: receiptFunc(be)}
	}

	s.handler = kickOnCreate(orders.NewHandler(s.ordersCfg), s.events.kick)
	s.metricsHandler = orders.MetricsHandler(s.ordersCfg)
	s.completer = idem.NewCompleter(swept, orders.NewCreateHandler(s.ordersCfg), idem.CompleterOptions{
		Interval:   completerInterval,
		Middleware: s.ordersCfg.IdemOptions,
		Logger:     logger,
		OnScan:     completerMetrics.OnScan,
		Funcs:      funcs,
	})
	// The cleaners: the order store's, and the in-process gateway's (an
	// external gateway forgets its own keys).
	s.cleaners = []*idem.Cleaner{be.cleaner(s.cleanerOptions(cleanOrders, "orders: cleaner deleted expired keys"))}
	if p.gw != nil {
		s.cleaners = append(s.cleaners, p.gw.NewCleaner(s.cleanerOptions(cleanGateway, "orders: cleaner deleted the in-process gateway's expired keys")))
	}
	return s, nil
}

// newTracerProvider returns a tracer provider that exports the service's
// spans over OTLP/HTTP in batches, when the environment names a collector
// (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, the full URL, or
// OTEL_EXPORTER_OTLP_ENDPOINT, the base URL to which /v1/traces is
// appended), and nil otherwise: then no span is recorded. The exporter
// reads its other settings (OTEL_EXPORTER_OTLP_HEADERS, _TIMEOUT,
// _COMPRESSION, certificates) from the process's environment, and the SDK
// its sampler (OTEL_TRACES_SAMPLER); the default samples every trace, or
// follows the caller's decision when the request carries a traceparent.
func newTracerProvider(ctx context.Context, getenv func(string) string) (*sdktrace.TracerProvider, error) {
	if strings.EqualFold(getenv("OTEL_SDK_DISABLED"), "true") {
		return nil, nil
	}
	switch e := getenv("OTEL_TRACES_EXPORTER"); strings.ToLower(e) {
	case "", "otlp":
	case "none":
		return nil, nil
	default:
		return nil, fmt.Errorf("OTEL_TRACES_EXPORTER=%q: this service exports only otlp (or none)", e)
	}
	name, url := "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
	if url == "" {
		name, url = "OTEL_EXPORTER_OTLP_ENDPOINT", getenv("OTEL_EXPORTER_OTLP_ENDPOINT")
		if url == "" {
			return nil, nil
		}
		url = strings.TrimSuffix(url, "/") + "/v1/traces"
	}
	if u, err := neturl.Parse(url); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("%s=%q: want http(s)://host:port", name, getenv(name))
	}
	for _, k := range []string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"} {
		if p := getenv(k); p != "" {
			if p != "http/protobuf" {
				return nil, fmt.Errorf("%s=%q: this service exports only http/protobuf", k, p)
			}
			break
		}
	}
	exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(url))
	if err != nil {
		return nil, fmt.Errorf("the OTLP trace exporter: %w", err)
	}
	service := getenv("OTEL_SERVICE_NAME")
	if service == "" {
		service = "orders"
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(attribute.String("service.name", service)))
	if err != nil {
		res = resource.Default()
	}
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res)), nil
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

// close stops the relay and the consumer if run did not, closes the NATS
// connection and the embedded server, flushes the spans not yet exported,
// then closes the database.
func (s *server) close() {
	if s.events != nil {
		s.events.stop()
	}
	if s.broker != nil {
		s.broker.close()
	}
	if s.tracer != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := s.tracer.Shutdown(ctx); err != nil {
			s.logger.Warn("orders: exporting the last traces", "err", err)
		}
		cancel()
	}
	s.backend.close()
}

// run serves on ln until ctx is done, then shuts down gracefully.
func (s *server) run(ctx context.Context, ln net.Listener) error {
	hs := newHTTPServer(s.handler)
	// The cleaner and the completer stop, and are waited for, before the
	// database is closed.
	bg, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer stop()
	for _, c := range s.cleaners {
		wg.Add(1)
		go func() { defer wg.Done(); c.Run(bg) }()
	}
	wg.Add(1)
	go func() { defer wg.Done(); s.completer.Run(bg) }()
	// Orders made before events get theirs, while the service answers;
	// then the outbox's sent events are swept (each round backfills again
	// first: see sweepOutbox).
	wg.Add(1)
	go func() {
		defer wg.Done()
		if _, err := backfillEvents(bg, s.backend, s.logger); err != nil && bg.Err() == nil {
			s.logger.Error("orders: writing the events of orders made before events; the next start tries again", "err", err)
		}
		s.sweepOutbox(bg)
	}()
	s.events.start(bg)

	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	var failed error
	select {
	case err := <-errc:
		return err
	case failed = <-s.events.failed:
		s.logger.Error("orders: stopping: the order events cannot run", "err", failed)
	case <-ctx.Done():
	}
	s.logger.Info("orders: shutting down")
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 15*time.Second)
	defer cancel()
	err := hs.Shutdown(sctx)
	if err == nil {
		if err = <-errc; errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
	}
	// Then the relay's last pass and the consumer; close closes the NATS
	// connection and the embedded server.
	s.events.stop()
	if failed != nil {
		return failed
	}
	return err
}

// The outbox's sweeps: every outboxSweepInterval, batches of
// outboxSweepBatch events, a pause between batches.
const (
	outboxSweepInterval = time.Minute
	outboxSweepBatch    = 1000
	outboxSweepPause    = 10 * time.Millisecond
)

// sweepOutbox deletes the outbox's events sent more than outboxRetention
// ago, every outboxSweepEvery, until ctx ends (the first round one period
// after the start-up backfill, which the round would repeat at once). It
// does nothing when the retention is 0.
//
// Each round first takes its cutoff by the database's clock (sent_at is
// the database's now() on PostgreSQL; SQLite's clock is the machine's),
// then backfills: every order that existed when the round began is then
// marked, and one an older binary writes meanwhile, which the backfill may
// miss, had its event sent after the round began, after the cutoff. So no
// sweep deletes the event of an unmarked order, which a later backfill
// would write and publish again. A round whose backfill fails deletes
// nothing.
func (s *server) sweepOutbox(ctx context.Context) {
	sw, ok := s.backend.outbox.(outbox.Sweeper)
	if s.outboxRetention <= 0 || !ok {
		return
	}
	t := time.NewTicker(s.outboxSweepEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.sweepOutboxOnce(ctx, sw, s.outboxRetention)
	}
}

// sweepOutboxOnce is one round of sweepOutbox, deleting the events sent
// more than retention ago.
func (s *server) sweepOutboxOnce(ctx context.Context, sw outbox.Sweeper, retention time.Duration) {
	now, err := s.backend.now(ctx)
	if err != nil {
		if ctx.Err() == nil {
			s.logger.Error("orders: reading the database's clock to sweep the outbox; the next sweep tries again", "err", err)
		}
		return
	}
	before := now.Add(-retention)
	if _, err := backfillEvents(ctx, s.backend, s.logger); err != nil {
		if ctx.Err() == nil {
			s.logger.Error("orders: writing the events of orders an older binary wrote, before sweeping the outbox; the next sweep tries again", "err", err)
		}
		return
	}
	deleted := 0
	for {
		n, err := sw.DeleteSent(ctx, before, outboxSweepBatch)
		deleted += n
		if err != nil {
			if ctx.Err() == nil {
				s.logger.Error("orders: deleting sent events from the outbox; the next sweep tries again", "err", err)
			}
			break
		}
		if n < outboxSweepBatch {
			break
		}
		select {
		case <-ctx.Done():
		case <-time.After(outboxSweepPause):
		}
	}
	if deleted > 0 {
		s.logger.Info("orders: deleted sent events from the outbox", "deleted", deleted, "sent_before", before.UTC().Format(time.RFC3339))
	}
}

// The background cleaner's sweeps and their batches.
const (
	cleanInterval = time.Minute
	cleanBatch    = 1000
	cleanPause    = 10 * time.Millisecond
)

// The store label of the cleaner's metrics.
const (
	cleanOrders  = "orders"  // the API's idempotency keys
	cleanGateway = "gateway" // the in-process gateway's
)

// cleanerOptions are the options of the cleaner of store (a label of the
// cleaner's metrics): each sweep is counted, and logged with done when it
// deleted keys, or as a warning when it failed.
func (s *server) cleanerOptions(store, done string) idem.CleanerOptions {
	return idem.CleanerOptions{
		Interval: cleanInterval,
		Batch:    cleanBatch,
		Pause:    cleanPause,
		Logger:   slog.New(slog.DiscardHandler), // OnSweep logs, naming the store
		OnSweep: func(ctx context.Context, st idem.CleanerStats, err error) {
			s.cleaned.WithLabelValues(store).Add(float64(st.Deleted))
			if err != nil && ctx.Err() == nil {
				s.cleanErrors.WithLabelValues(store).Inc()
				s.logger.WarnContext(ctx, "orders: cleaner", "store", store, "err", err)
			} else if st.Deleted > 0 {
				s.logger.InfoContext(ctx, done, "count", st.Deleted)
			}
		},
	}
}
