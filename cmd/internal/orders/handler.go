package orders

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/api"
	"github.com/idem-go/idem/cmd/internal/ratelimit"
	"github.com/idem-go/idem/idemotel"
)

// Config configures NewHandler.
type Config struct {
	// Repo stores orders. Required.
	Repo Repository
	// Payer pays for orders. Required.
	Payer Payer
	// Idem is the idempotency store behind POST /v1/orders. Required.
	Idem idem.Store
	// IdemOptions configures the idempotency middleware. NewHandler sets
	// User (the bearer token's sub) and, when they are zero, Stored
	// (StoredStatus), MaxStoredBody (MaxStoredResponse), Fingerprint
	// (idem.FingerprintWithoutQuery: the order API reads no query on
	// POST), Metrics and Logger; the other fields keep their idem
	// defaults when zero.
	IdemOptions idem.Options
	// Secret is the HS256 key of bearer tokens. Required.
	Secret []byte
	// Now is the clock for token expiry and created_at. Default time.Now.
	Now func() time.Time
	// Health reports whether the service can work, for GET /healthz.
	// Default Repo.Ping.
	Health func(ctx context.Context) error
	// Logger receives failures that clients see as 5xx. Default
	// slog.Default().
	Logger *slog.Logger
	// Metrics counts orders and payments for GET /metrics. Default a new
	// Metrics; pass one to share it with NewCreateHandler.
	Metrics *Metrics
	// PaymentTimeout bounds the payment call and the write of the order.
	// Neither is cancelled when the client goes away, so that an outcome
	// that was paid for is committed and replayed to the client's retry.
	// Default DefaultPaymentTimeout; keep it below IdemOptions.Lease.
	PaymentTimeout time.Duration
	// PaymentKeyRetention is how long the gateway keeps an idempotency
	// key after its first use (Stripe: 24 hours). When an attempt after an
	// operation's first cannot look up the order's payment (the gateway's
	// search fails), it pays with the operation's payment key only if the
	// operation is younger than PaymentKeyRetention less a margin of
	// min(1h, PaymentKeyRetention/2), which covers the clock skew between
	// this instance and the database that stamped the key's creation time:
	// the gateway then surely remembers the key, so paying replays any
	// earlier payment. An older operation answers 502 (not stored), since
	// paying could charge twice. Default DefaultPaymentKeyRetention.
	PaymentKeyRetention time.Duration
	// Gatherer is what GET /metrics serves (in the Prometheus text format,
	// or another that the scraper asks for). Default NewRegistry(Metrics,
	// IdemOptions.Metrics); a service that has more to show (the Redis
	// fast path's counters, the store's latency, the Go runtime) registers
	// Metrics and the rest in a registry of its own and passes it here.
	Gatherer prometheus.Gatherer
	// TracerProvider makes the spans of the API: one server span per
	// request, named by its route (a kind of SpanKindServer, with
	// http.request.method, http.route and http.response.status_code, never
	// the raw path), and the span idem.handler around the create handler
	// (idemotel.Handler). Spans of the idempotency store are made by
	// wrapping Idem (idemotel.WrapStore). Default otel.GetTracerProvider(),
	// which makes nothing unless the program set one.
	TracerProvider trace.TracerProvider
	// Propagator reads the trace context of a request (the traceparent
	// header), so that its server span joins the caller's trace. Default
	// otel.GetTextMapPropagator(), which reads nothing unless the program
	// set one.
	Propagator propagation.TextMapPropagator
	// MetricsElsewhere leaves GET /metrics out of the API (404): it is
	// served on an address of its own by MetricsHandler.
	MetricsElsewhere bool
	// Page, if set, serves the checkout page: GET / and every path under
	// /checkout/. Nil: those paths are 404.
	Page http.Handler
	// GuestCheckout accepts guest tokens (IssueGuestToken, scope
	// GuestScope), which the checkout page's guest sign-in hands out. Off:
	// a guest token is refused with 401.
	GuestCheckout bool
	// GuestOrderLimit caps the orders of a guest token's user: POST
	// /v1/orders with a guest token whose user has this many orders
	// already is answered 403 ProblemGuestOrderLimit before the payment.
	// Default DefaultGuestOrderLimit.
	GuestOrderLimit int
	// UserRateEvery and UserRateBurst bound each user's POST /v1/orders
	// (per instance): UserRateBurst at once, then one per UserRateEvery;
	// beyond, 429 ProblemRateLimited. Zero: DefaultUserRateEvery and
	// DefaultUserRateBurst; a negative UserRateEvery: no limit.
	UserRateEvery time.Duration
	UserRateBurst int
	// MaxLiveKeys bounds the unexpired idempotency keys of one user, when
	// Repo is a LiveKeyCounter: an order that would make more is answered
	// 429 ProblemTooManyKeys before it is paid. Zero: DefaultMaxLiveKeys;
	// negative: no bound.
	MaxLiveKeys int
}

// DefaultGuestOrderLimit is the default Config.GuestOrderLimit.
const DefaultGuestOrderLimit = 10

// DefaultPaymentTimeout is the default Config.PaymentTimeout: an attempt
// makes no payment call later than this after it began.
const DefaultPaymentTimeout = 20 * time.Second

// DefaultPaymentKeyRetention is the default Config.PaymentKeyRetention:
// Stripe's 24 hours, as payments.DefaultKeyRetention.
const DefaultPaymentKeyRetention = 24 * time.Hour

// paymentKeyMargin is how much younger than retention an operation must be
// for a payment with its key to be surely deduplicated by the gateway:
// min(1h, retention/2), for the clock skew between this instance and the
// database that stamped the key's creation time.
func paymentKeyMargin(retention time.Duration) time.Duration {
	return min(time.Hour, retention/2)
}

// Routes, as metrics label them.
const (
	routeCreate  = "POST /v1/orders"
	routeList    = "GET /v1/orders"
	routeGet     = "GET /v1/orders/{id}"
	routeHealth  = "GET /healthz"
	routeMetrics = "GET /metrics"
	routeSpec    = "GET /openapi.yaml"
	routePage    = "checkout page"
	routeOther   = "other"
)

type server struct {
	cfg        Config
	metrics    *Metrics
	idemM      *idem.Metrics
	create     http.Handler // auth, then idem, then createOrder
	rpc        http.Handler // orders.v1.OrderService, through create
	prom       http.Handler // promhttp's, for GET /metrics
	tracer     trace.Tracer
	propagator propagation.TextMapPropagator
	guests     *guestSlots      // the guests' orders in flight in this instance
	users      *ratelimit.Keyed // each user's POST /v1/orders
}

func newServer(cfg Config) *server {
	switch {
	case cfg.Repo == nil:
		panic("orders: Config.Repo is nil")
	case cfg.Payer == nil:
		panic("orders: Config.Payer is nil")
	case cfg.Idem == nil:
		panic("orders: Config.Idem is nil")
	case len(cfg.Secret) == 0:
		panic("orders: Config.Secret is empty")
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Health == nil {
		cfg.Health = cfg.Repo.Ping
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = new(Metrics)
	}
	if cfg.PaymentTimeout <= 0 {
		cfg.PaymentTimeout = DefaultPaymentTimeout
	}
	if cfg.PaymentKeyRetention <= 0 {
		cfg.PaymentKeyRetention = DefaultPaymentKeyRetention
	}
	if cfg.GuestOrderLimit <= 0 {
		cfg.GuestOrderLimit = DefaultGuestOrderLimit
	}
	if cfg.UserRateEvery == 0 {
		cfg.UserRateEvery = DefaultUserRateEvery
	}
	if cfg.UserRateBurst <= 0 {
		cfg.UserRateBurst = DefaultUserRateBurst
	}
	if cfg.MaxLiveKeys == 0 {
		cfg.MaxLiveKeys = DefaultMaxLiveKeys
	}
	if cfg.IdemOptions.Stored == nil {
		cfg.IdemOptions.Stored = StoredStatus
	}
	if cfg.IdemOptions.MaxStoredBody == 0 {
		cfg.IdemOptions.MaxStoredBody = MaxStoredResponse
	}
	if cfg.IdemOptions.Fingerprint == nil {
		// The contract's fingerprint is method, route and body: POST
		// /v1/orders reads no query, so a parameter added to a retry
		// (by a client or a proxy) leaves it the same order.
		cfg.IdemOptions.Fingerprint = idem.FingerprintWithoutQuery
	}
	if cfg.IdemOptions.Metrics == nil {
		cfg.IdemOptions.Metrics = new(idem.Metrics)
	}
	if cfg.IdemOptions.Logger == nil {
		cfg.IdemOptions.Logger = cfg.Logger
	}
	cfg.IdemOptions.User = func(r *http.Request) string {
		u, _ := UserFromContext(r.Context())
		return u
	}
	if cfg.Gatherer == nil {
		cfg.Gatherer = NewRegistry(cfg.Metrics, cfg.IdemOptions.Metrics)
	}
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = otel.GetTracerProvider()
	}
	if cfg.Propagator == nil {
		cfg.Propagator = otel.GetTextMapPropagator()
	}
	s := &server{cfg: cfg, metrics: cfg.Metrics, idemM: cfg.IdemOptions.Metrics,
		tracer: cfg.TracerProvider.Tracer(tracerName), propagator: cfg.Propagator, guests: newGuestSlots()}
	if cfg.UserRateEvery > 0 {
		s.users = ratelimit.New(cfg.UserRateEvery, cfg.UserRateBurst)
	}
	s.prom = promhttp.HandlerFor(cfg.Gatherer, promhttp.HandlerOpts{
		// A collector that fails leaves the others' metrics served.
		ErrorHandling: promhttp.ContinueOnError,
		// OpenMetrics for a scraper that asks for it in Accept.
		EnableOpenMetrics: true,
		ErrorLog:          promLogger{cfg.Logger},
	})
	// The media type is checked, and a guest's slot held, before the key is
	// claimed; the slot is given back once the middleware has committed.
	s.create = s.auth(s.limitUser(requireJSON(s.guestGate(idem.Middleware(cfg.Idem, cfg.IdemOptions)(s.createHandler())))))
	s.rpc = newRPCHandler(s.create)
	return s
}

// tracerName is the instrumentation scope of the API's spans.
const tracerName = "github.com/idem-go/idem/cmd/internal/orders"

// createHandler is createOrder with the span idem.handler around it.
func (s *server) createHandler() http.Handler {
	return idemotel.Handler(http.HandlerFunc(s.createOrder), idemotel.Options{TracerProvider: s.cfg.TracerProvider})
}

// promLogger logs promhttp's errors.
type promLogger struct{ l *slog.Logger }

func (p promLogger) Println(v ...any) { p.l.Error("orders: serving /metrics", "err", fmt.Sprint(v...)) }

// MaxStoredResponse bounds the stored answer of POST /v1/orders, the
// default of Config.IdemOptions.MaxStoredBody. Every valid order's answer
// fits with room to spare: at most MaxItems items whose sku JSON may escape
// to six bytes a character, a user of MaxUser bytes, so under 50 KiB. (The
// middleware never releases a key whose work committed, whatever the
// answer's size; this bound only keeps every answer replayable.)
const MaxStoredResponse = 3*MaxBody + 64<<10

// StoredStatus is the idem Options.Stored of POST /v1/orders (NewHandler's
// default; give it to the completer too): idem.StoredStatus (2xx, 3xx, 402)
// and 422, which the handler answers, refunded, when the database refuses
// the order for good (ProblemOrderNotWritable). The middleware's own 422
// (the key reused with another request) is written before the handler runs
// and is never stored.
func StoredStatus(status int) bool {
	return idem.StoredStatus(status) || status == http.StatusUnprocessableEntity
}

// NewHandler returns the order API:
//
//	POST /v1/orders                              create (auth, Idempotency-Key)
//	GET  /v1/orders?limit=N&starting_after=ID    list the caller's orders
//	GET  /v1/orders/{id}                         one of the caller's orders
//	GET  /healthz                                200, or 503 when Health fails
//	GET  /metrics                                Prometheus text format
//	GET  /openapi.yaml                           the OpenAPI description
//	GET  /, /checkout/…                          the checkout page (Config.Page)
//	POST /orders.v1.OrderService/CreateOrder     create over Connect, gRPC, gRPC-Web
//	                                             (shares POST /v1/orders' keys)
//
// Every error is application/problem+json (see ProblemTypes), but
// CreateOrder's, which are its protocol's errors, with the problem in a
// google.rpc.ErrorInfo (see rpcError).
func NewHandler(cfg Config) http.Handler { return newServer(cfg) }

// MetricsHandler serves GET /metrics alone (every other path is 404), with
// the counters of cfg, for an address of its own; see
// Config.MetricsElsewhere.
func MetricsHandler(cfg Config) http.Handler {
	s := newServer(cfg)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Path != "/metrics":
			writeProblem(w, newProblem(ProblemNotFound, http.StatusNotFound, "Not found", "No route "+r.URL.Path+"."))
		case r.Method != http.MethodGet && r.Method != http.MethodHead:
			w.Header().Set("Allow", "GET, HEAD")
			writeProblem(w, newProblem(ProblemMethodNotAllowed, http.StatusMethodNotAllowed, "Method not allowed", r.Method+" is not allowed on /metrics."))
		default:
			s.writeMetrics(w, r)
		}
	})
}

// NewCreateHandler returns the handler that POST /v1/orders runs behind
// authentication and the idempotency middleware. It takes the user from the
// idem lease in the request's context, so the completer can re-drive a
// stored request through it without a bearer token.
func NewCreateHandler(cfg Config) http.Handler {
	return newServer(cfg).createHandler()
}

func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	sw := &statusWriter{ResponseWriter: w}
	route := routeOther
	var inner *int // CreateOrder over RPC: its create's HTTP status (rpcService)
	ctx, span := s.tracer.Start(s.propagator.Extract(r.Context(), propagation.HeaderCarrier(r.Header)), "HTTP",
		trace.WithSpanKind(trace.SpanKindServer), trace.WithTimestamp(start))
	if sc := span.SpanContext(); span.IsRecording() || sc.IsValid() {
		r = r.WithContext(ctx)
	}
	defer func() {
		v := recover()
		if v != nil && v != http.ErrAbortHandler {
			s.cfg.Logger.ErrorContext(r.Context(), "orders: handler panicked", "route", route, "panic", v)
			if sw.code == 0 {
				writeProblem(sw, idem.ProblemFor(errors.New("panic")))
			}
		}
		endServerSpan(span, r.Method, route, sw.code, v != nil)
		if v == http.ErrAbortHandler {
			panic(v) // net/http drops the connection: no answer to count
		}
		code := sw.code
		if inner != nil && *inner != 0 {
			code = *inner // an RPC's create: the status POST /v1/orders answered it
		}
		s.metrics.observe(route, code, time.Since(start))
	}()
	// Every answer to a request that carried a key echoes it, whatever
	// refuses the request (the middleware sets it too).
	if k := r.Header.Values("Idempotency-Key"); len(k) > 0 {
		sw.Header().Set("Idempotency-Key", k[0])
	}

	var get, post http.Handler
	var getRoute string
	path := r.URL.Path
	switch {
	case path == "/v1/orders":
		get, getRoute, post = s.auth(http.HandlerFunc(s.listOrders)), routeList, s.create
	case strings.HasPrefix(path, "/v1/orders/") && validID(path[len("/v1/orders/"):]):
		get, getRoute = s.auth(http.HandlerFunc(s.getOrder)), routeGet
	case path == routeCreateRPC:
		// Only POST: every other method is the API's 405 problem. Connect
		// answers the content types it does not speak.
		if r.Method != http.MethodPost {
			sw.Header().Set("Allow", "POST")
			writeProblem(sw, newProblem(ProblemMethodNotAllowed, http.StatusMethodNotAllowed, "Method not allowed",
				r.Method+" is not allowed on "+path+"; allowed: POST."))
			return
		}
		if ct := r.Header.Values("Content-Type"); len(ct) > 0 && !isRPCMediaType(ct[0]) {
			// Connect would answer 415 with no body: the API's problem.
			writeUnsupportedMediaType(sw, "application/proto, application/json, application/grpc, application/grpc-web",
				path+" speaks Connect, gRPC and gRPC-Web: send Content-Type application/proto, application/json, application/grpc… or application/grpc-web….")
			return
		}
		route = routeCreateRPC
		inner = new(int)
		s.rpc.ServeHTTP(sw, r.WithContext(context.WithValue(r.Context(), innerStatusKey{}, inner)))
		return
	case path == "/healthz":
		get, getRoute = http.HandlerFunc(s.health), routeHealth
	case path == "/metrics" && !s.cfg.MetricsElsewhere:
		get, getRoute = http.HandlerFunc(s.writeMetrics), routeMetrics
	case path == "/openapi.yaml":
		get, getRoute = http.HandlerFunc(serveSpec), routeSpec
	case (path == "/" || strings.HasPrefix(path, "/checkout/")) && s.cfg.Page != nil:
		// The page answers its own methods and unknown files.
		route = routePage
		s.cfg.Page.ServeHTTP(sw, r)
		return
	default:
		writeProblem(sw, newProblem(ProblemNotFound, http.StatusNotFound, "Not found", "No route "+path+"."))
		return
	}
	switch {
	case (r.Method == http.MethodGet || r.Method == http.MethodHead) && get != nil:
		route = getRoute
		get.ServeHTTP(sw, r)
	case r.Method == http.MethodPost && post != nil:
		route = routeCreate
		post.ServeHTTP(sw, r)
	default:
		allow := "GET, HEAD"
		if post != nil {
			allow = "GET, HEAD, POST"
		}
		sw.Header().Set("Allow", allow)
		writeProblem(sw, newProblem(ProblemMethodNotAllowed, http.StatusMethodNotAllowed, "Method not allowed",
			r.Method+" is not allowed on "+path+"; allowed: "+allow+"."))
	}
}

// serveSpec serves the OpenAPI description of the API.
func serveSpec(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/yaml")
	w.Header().Set("Content-Length", strconv.Itoa(len(api.OpenAPI)))
	if r.Method != http.MethodHead {
		w.Write(api.OpenAPI)
	}
}

// validID reports whether s can be an order id in a path: one segment.
func validID(s string) bool { return s != "" && !strings.Contains(s, "/") }

func (s *server) auth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id, detail := authenticateToken(r, s.cfg.Secret, s.cfg.Now, s.cfg.GuestCheckout)
		if detail != "" {
			challenge := `Bearer realm="orders"`
			if r.Header.Get("Authorization") != "" {
				challenge += `, error="invalid_token"`
			}
			w.Header().Set("WWW-Authenticate", challenge)
			writeProblem(w, newProblem(ProblemUnauthorized, http.StatusUnauthorized, "Unauthorized", detail))
			return
		}
		ctx := withUser(r.Context(), id.user)
		if id.guest {
			ctx = withGuest(ctx)
		}
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// createOrder validates, pays, then writes the order: no transaction is open
// while the gateway is called, and the order is written through the
// idempotent request's transaction, which commits it with the response.
func (s *server) createOrder(w http.ResponseWriter, r *http.Request) {
	lease, protected := idem.LeaseFromContext(r.Context())
	var user string
	if protected {
		user = lease.User
	} else if u, ok := UserFromContext(r.Context()); ok {
		user = u
	} else {
		writeProblem(w, newProblem(ProblemUnauthorized, http.StatusUnauthorized, "Unauthorized", "The request is not authenticated."))
		return
	}

	r.Body = http.MaxBytesReader(w, r.Body, MaxBody)
	req, total, err := decodeCreate(r.Body)
	if err != nil {
		writeProblem(w, requestProblem(err))
		return
	}

	// A guest's first attempt at an operation takes a slot under the cap
	// before anything is paid; later attempts finish an operation that
	// was let in.
	if !protected || lease.Attempt <= 1 {
		if !s.admitGuest(r.Context(), w, user) || !s.admitLiveKeys(r.Context(), w, user) {
			return
		}
	}

	// The work goes on when the client goes away: once paid, the order is
	// committed and its answer stored for the client's retry.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), s.cfg.PaymentTimeout)
	defer cancel()

	o := &Order{UserID: user, Status: StatusPaid, Items: req.Items, Total: total, Currency: req.Currency}
	payKey, refundKey := randomPaymentKey(), randomPaymentKey()
	o.ID = randomOrderID()
	if protected {
		// The key's creation time names this operation: every attempt at it
		// (retries, takeovers, the completer) derives the same values, and a
		// key used again after it expired derives new ones.
		since := lease.CreatedAt
		payKey = PaymentKey(lease.User, lease.Key, since)
		refundKey = RefundKey(lease.User, lease.Key, since)
		o.ID = OrderID(lease.User, lease.Key, since)
		o.IdempotencyKey, o.KeyCreatedAt = lease.Key, since
	}

	// An attempt after the operation's first (a retry after a 5xx, a
	// takeover, a re-drive) may follow one that paid and then failed. Its
	// payment key dedups only while the gateway remembers it (Stripe: 24
	// hours), and a record without an answer never expires, so the
	// payment is looked up by the order's reference first: a succeeded
	// one is the order's, and nothing is charged. Stripe's search is
	// eventually consistent (indexed within about a minute), which is
	// still safe: a payment too recent to be found is within the key's
	// retention, so paying with the key replays it; one made before the
	// key was forgotten was indexed long ago, so it is found. When the
	// search fails, an operation young enough that the gateway surely
	// still remembers its payment key (Config.PaymentKeyRetention less
	// the margin for clock skew) pays with the key, which replays any
	// earlier payment; an older one answers 502, not stored, since paying
	// could charge twice.
	var (
		res   PaymentResult
		found bool
	)
	if protected && lease.Attempt > 1 {
		if res, found, err = s.cfg.Payer.FindPayment(ctx, o.ID); err != nil {
			s.metrics.GatewayErrors.Add(1)
			age, limit := s.cfg.Now().Sub(lease.CreatedAt), s.cfg.PaymentKeyRetention-paymentKeyMargin(s.cfg.PaymentKeyRetention)
			if age >= limit {
				s.cfg.Logger.ErrorContext(ctx, "orders: looking up the order's payment failed, and the gateway may have forgotten its payment key",
					"user", user, "order", o.ID, "attempt", lease.Attempt, "age", age, "err", err)
				writeProblem(w, newProblem(ProblemPaymentGateway, http.StatusBadGateway, "Payment gateway error",
					"The payment gateway failed or did not answer. Nothing was stored; retry with the same Idempotency-Key, which never charges twice."))
				return
			}
			s.cfg.Logger.WarnContext(ctx, "orders: looking up the order's payment failed; paying with the operation's payment key, which the gateway still remembers",
				"user", user, "order", o.ID, "attempt", lease.Attempt, "age", age, "err", err)
			res, found = PaymentResult{}, false
		}
	}
	if !found {
		res, err = s.cfg.Payer.Pay(ctx, PaymentRequest{Amount: total, Currency: req.Currency, IdempotencyKey: payKey, OrderRef: o.ID})
	}
	if err == nil && res.ID == "" {
		err = errors.New("orders: gateway returned no payment id")
	}
	switch {
	case err == nil && found:
		s.metrics.PaymentsFound.Add(1)
		s.cfg.Logger.InfoContext(ctx, "orders: an earlier attempt paid for the order; using its payment", "user", user, "order", o.ID, "payment", res.ID, "attempt", lease.Attempt)
	case err == nil:
		s.metrics.PaymentsMade.Add(1)
	case errors.Is(err, ErrDeclined):
		s.metrics.PaymentsDeclined.Add(1)
		writeProblem(w, newProblem(ProblemPaymentDeclined, http.StatusPaymentRequired, "Payment declined",
			"The payment gateway declined the payment, so no order was created. This answer is final for this Idempotency-Key; use a new key to try again."))
		return
	default:
		s.metrics.GatewayErrors.Add(1)
		s.cfg.Logger.ErrorContext(ctx, "orders: payment failed", "user", user, "order", o.ID, "err", err)
		writeProblem(w, newProblem(ProblemPaymentGateway, http.StatusBadGateway, "Payment gateway error",
			"The payment gateway failed or did not answer. Nothing was stored; retry with the same Idempotency-Key, which never charges twice."))
		return
	}

	o.PaymentID = res.ID
	o.CreatedAt = s.cfg.Now().UTC().Truncate(time.Microsecond)
	switch err := s.cfg.Repo.Create(ctx, o); {
	case err == nil:
		s.metrics.OrdersCreated.Add(1)
	case errors.Is(err, ErrExists):
		writeProblem(w, newProblem(ProblemOrderConflict, http.StatusConflict, "Order already exists",
			"The order for this Idempotency-Key was created by another attempt; retry with the same key to get its answer."))
		return
	case errors.Is(err, ErrUnwritable):
		s.refundUnwritable(ctx, w, o, refundKey, err)
		return
	default:
		s.cfg.Logger.ErrorContext(ctx, "orders: writing order", "user", user, "order", o.ID, "payment", o.PaymentID, "err", err)
		w.Header().Set("Retry-After", "1")
		writeProblem(w, newProblem(ProblemUnavailable, http.StatusServiceUnavailable, "Service unavailable",
			"The order could not be written. Nothing was stored; retry with the same Idempotency-Key, which never charges twice."))
		return
	}
	w.Header().Set("Location", "/v1/orders/"+o.ID)
	writeJSON(w, http.StatusCreated, o)
}

// Limits of GET /v1/orders.
const (
	DefaultListLimit = 100
	MaxListLimit     = 100
)
