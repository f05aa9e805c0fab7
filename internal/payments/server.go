package payments

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

// DefaultLockWait is the default Config.LockWait.
const DefaultLockWait = 2 * time.Second

// Config configures a Server. The zero value is usable: every field
// documents its default.
type Config struct {
	// APIKey is the only secret key accepted. Default "": any key that
	// starts with "sk_test_". Each key is its own account: idempotency keys
	// and PaymentIntents are scoped to it.
	APIKey string
	// Store keeps the idempotency keys. Default memstore.New.
	Store idem.Store
	// Ledger keeps the PaymentIntents, and must commit with Store's
	// transactions: a MemLedger with a memstore.Store, a PGLedger with a
	// pgstore.Store on the same database and schema, a SQLiteLedger with
	// a sqlitestore.Store on the same file (OpenPostgres and OpenSQLite
	// return such pairs). Default a new MemLedger, so it is required with
	// any other Store.
	Ledger Ledger
	// LockWait is how long a repeat waits for a running attempt with the
	// same key before it is answered 429 lock_timeout. Default
	// DefaultLockWait; negative means not at all.
	LockWait time.Duration
	// KeyTTL is how long an idempotency key lives. Default idem.DefaultTTL
	// (24h, as at Stripe).
	KeyTTL time.Duration

	// Latency is added before each charge is made. Default 0.
	Latency time.Duration
	// FailAfterCharge is the fraction (0..1) of first attempts of an
	// idempotency key whose outcome is committed and whose connection is
	// then dropped without an answer. Default 0.
	FailAfterCharge float64
	// DeclineOver declines amounts above it. Default 0: no limit.
	DeclineOver int64

	// Metrics, if set, counts what the idempotency middleware did.
	Metrics *idem.Metrics
	// Logger receives store failures and injected faults. Default
	// slog.Default().
	Logger *slog.Logger
	// Now is the clock for the created timestamps. Default time.Now.
	Now func() time.Time
}

// Validate reports the first invalid field of c.
func (c Config) Validate() error {
	switch {
	case c.FailAfterCharge < 0 || c.FailAfterCharge > 1:
		return fmt.Errorf("payments: FailAfterCharge %v is not within 0..1", c.FailAfterCharge)
	case c.DeclineOver < 0:
		return fmt.Errorf("payments: DeclineOver %d is negative", c.DeclineOver)
	case c.Latency < 0:
		return fmt.Errorf("payments: Latency %v is negative", c.Latency)
	}
	if _, mem := c.Store.(*memstore.Store); c.Ledger == nil && c.Store != nil && !mem {
		return fmt.Errorf("payments: a Store of type %T needs a Ledger that commits with it (the default MemLedger needs a memstore.Store)", c.Store)
	}
	return nil
}

// Server is the gateway's http.Handler.
type Server struct {
	cfg    Config
	ledger Ledger
	create http.Handler // POST /v1/payment_intents, wrapped

	dropped atomic.Int64 // connections dropped by FailAfterCharge
}

// NewServer returns a gateway configured by cfg. It panics if cfg is
// invalid (see Config.Validate).
func NewServer(cfg Config) *Server {
	if err := cfg.Validate(); err != nil {
		panic(err)
	}
	if cfg.Store == nil {
		cfg.Store = memstore.New(memstore.Options{})
	}
	if cfg.Ledger == nil {
		cfg.Ledger = NewMemLedger()
	}
	switch {
	case cfg.LockWait == 0:
		cfg.LockWait = DefaultLockWait
	case cfg.LockWait < 0:
		cfg.LockWait = 0
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	s := &Server{cfg: cfg, ledger: cfg.Ledger}
	mw := idem.Middleware(cfg.Store, idem.Options{
		TTL: cfg.KeyTTL,
		// The lease must outlast any attempt, injected latency included;
		// an attempt that outlives it is fenced off and rolled back.
		Lease:         idem.DefaultLease + cfg.Latency,
		InFlightWait:  cfg.LockWait,
		OptionalKey:   true, // as at Stripe
		User:          func(r *http.Request) string { return accountFrom(r.Context()) },
		Fingerprint:   fingerprint,
		StoredHeaders: []string{"Content-Type", "Original-Request"},
		ErrorHandler:  writeIdemError,
		Metrics:       cfg.Metrics,
		Logger:        cfg.Logger,
	})
	s.create = s.dropAfterCharge(mw(http.HandlerFunc(s.createIntent)))
	return s
}

// Ledger returns the server's ledger.
func (s *Server) Ledger() Ledger { return s.ledger }

type ctxKey int

const (
	accountKey ctxKey = iota
	requestIDKey
)

func accountFrom(ctx context.Context) string {
	a, _ := ctx.Value(accountKey).(string)
	return a
}

func requestIDFrom(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey).(string)
	return id
}

// AccountFor returns the account an API key belongs to: a digest of the
// key, so that stores and logs never hold the secret itself.
func AccountFor(apiKey string) string {
	sum := sha256.Sum256([]byte(apiKey))
	return "acct_" + hex.EncodeToString(sum[:8])
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	reqID := newID("req_", 14)
	h := w.Header()
	h.Set("Request-Id", reqID)
	h.Set("Cache-Control", "no-cache, no-store")
	ctx := context.WithValue(r.Context(), requestIDKey, reqID)

	key, ok := s.authenticate(w, r)
	if !ok {
		return
	}
	ctx = context.WithValue(ctx, accountKey, AccountFor(key))
	r = r.WithContext(ctx)

	const collection = "/v1/payment_intents"
	switch p := r.URL.Path; {
	case p == collection && r.Method == http.MethodPost:
		s.create.ServeHTTP(w, r)
	case p == collection && r.Method == http.MethodGet:
		s.listIntents(w, r)
	case strings.HasPrefix(p, collection+"/") && r.Method == http.MethodGet:
		id := strings.TrimPrefix(p, collection+"/")
		if id == "" || strings.Contains(id, "/") {
			writeUnrecognized(w, r)
			return
		}
		s.getIntent(w, r, id)
	default:
		writeUnrecognized(w, r)
	}
}

// authenticate reads the secret key from a Bearer (or, as Stripe also
// takes it, Basic) Authorization header and checks it.
func (s *Server) authenticate(w http.ResponseWriter, r *http.Request) (string, bool) {
	auth := r.Header.Get("Authorization")
	var key string
	if scheme, rest, ok := strings.Cut(auth, " "); ok && strings.EqualFold(scheme, "Bearer") {
		key = strings.TrimSpace(rest)
	} else if user, _, ok := r.BasicAuth(); ok {
		key = user
	}
	unauthorized := func(msg string) (string, bool) {
		w.Header().Set("WWW-Authenticate", `Bearer realm="payments"`)
		writeError(w, http.StatusUnauthorized, &PaymentError{Type: "invalid_request_error", Message: msg})
		return "", false
	}
	if key == "" {
		return unauthorized("You did not provide an API key. Provide your secret key in the Authorization header, using Bearer auth (e.g. 'Authorization: Bearer YOUR_SECRET_KEY').")
	}
	var valid bool
	if s.cfg.APIKey == "" {
		valid = strings.HasPrefix(key, "sk_test_") && len(key) > len("sk_test_")
	} else {
		valid = subtle.ConstantTimeCompare([]byte(key), []byte(s.cfg.APIKey)) == 1
	}
	if !valid {
		return unauthorized("Invalid API Key provided: " + redactKey(key))
	}
	return key, true
}

func redactKey(k string) string {
	if len(k) <= 12 {
		return strings.Repeat("*", len(k))
	}
	return k[:8] + strings.Repeat("*", 4) + k[len(k)-4:]
}

func (s *Server) getIntent(w http.ResponseWriter, r *http.Request, id string) {
	pi, err := s.ledger.Get(r.Context(), accountFrom(r.Context()), id)
	switch {
	case errors.Is(err, ErrNotFound):
		writeError(w, http.StatusNotFound, &PaymentError{Type: "invalid_request_error", Code: "resource_missing", Param: "intent", Message: fmt.Sprintf("No such payment_intent: '%s'", id)})
	case err != nil:
		s.internalError(w, r, "get", err)
	default:
		writeJSON(w, http.StatusOK, pi)
	}
}

// listObject is Stripe's list envelope.
type listObject struct {
	Object  string           `json:"object"`
	Data    []*PaymentIntent `json:"data"`
	HasMore bool             `json:"has_more"`
	URL     string           `json:"url"`
}

func (s *Server) listIntents(w http.ResponseWriter, r *http.Request) {
	qv := r.URL.Query()
	q := ListQuery{
		Account:       accountFrom(r.Context()),
		Limit:         DefaultListLimit,
		StartingAfter: qv.Get("starting_after"),
		EndingBefore:  qv.Get("ending_before"),
	}
	if v := qv.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		switch {
		case err != nil:
			writeParamError(w, "limit", "parameter_invalid_integer", "Invalid integer: "+v)
			return
		case n < 1:
			writeParamError(w, "limit", "parameter_invalid_integer", "This value must be greater than or equal to 1.")
			return
		case n > MaxListLimit:
			writeParamError(w, "limit", "parameter_invalid_integer", fmt.Sprintf("This value must be less than or equal to %d.", MaxListLimit))
			return
		}
		q.Limit = n
	}
	if q.StartingAfter != "" && q.EndingBefore != "" {
		writeParamError(w, "ending_before", "", "You may only specify one of these parameters: ending_before, starting_after.")
		return
	}
	p, err := s.ledger.List(r.Context(), q)
	switch {
	case errors.Is(err, ErrNotFound):
		param, id := "starting_after", q.StartingAfter
		if q.EndingBefore != "" {
			param, id = "ending_before", q.EndingBefore
		}
		writeParamError(w, param, "resource_missing", fmt.Sprintf("No such payment_intent: '%s'", id))
		return
	case err != nil:
		s.internalError(w, r, "list", err)
		return
	}
	if p.Data == nil {
		p.Data = []*PaymentIntent{}
	}
	writeJSON(w, http.StatusOK, listObject{Object: "list", Data: p.Data, HasMore: p.HasMore, URL: "/v1/payment_intents"})
}

func (s *Server) internalError(w http.ResponseWriter, r *http.Request, op string, err error) {
	s.cfg.Logger.ErrorContext(r.Context(), "payments: "+op+" failed", "request_id", requestIDFrom(r.Context()), "err", err)
	writeError(w, http.StatusInternalServerError, &PaymentError{Type: "api_error", Message: "An unknown error occurred; nothing was charged."})
}

// writeJSON writes v indented, as Stripe does.
func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		status = http.StatusInternalServerError
		b = []byte(`{"error":{"type":"api_error","message":"An unknown error occurred."}}`)
	}
	b = append(b, '\n')
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	w.Write(b)
}

func writeError(w http.ResponseWriter, status int, e *PaymentError) {
	writeJSON(w, status, struct {
		Error *PaymentError `json:"error"`
	}{e})
}

func writeParamError(w http.ResponseWriter, param, code, msg string) {
	writeError(w, http.StatusBadRequest, &PaymentError{Type: "invalid_request_error", Code: code, Param: param, Message: msg})
}

func writeUnrecognized(w http.ResponseWriter, r *http.Request) {
	writeError(w, http.StatusNotFound, &PaymentError{Type: "invalid_request_error", Message: fmt.Sprintf("Unrecognized request URL (%s: %s).", r.Method, r.URL.Path)})
}

// writeIdemError is the idempotency middleware's ErrorHandler: its errors
// as Stripe reports them.
func writeIdemError(w http.ResponseWriter, r *http.Request, err error) {
	key := r.Header.Get("Idempotency-Key")
	switch {
	case errors.Is(err, idem.ErrFingerprintMismatch):
		writeError(w, http.StatusBadRequest, &PaymentError{Type: "idempotency_error", Message: fmt.Sprintf("Keys for idempotent requests can only be used with the same parameters they were first used with. Try using a key other than '%s' if you meant to execute a different request.", key)})
	case errors.Is(err, idem.ErrInFlight), errors.Is(err, idem.ErrFenced):
		// stripe-go retries a 429 whose code is lock_timeout.
		w.Header().Set("Stripe-Should-Retry", "true")
		writeError(w, http.StatusTooManyRequests, &PaymentError{Type: "invalid_request_error", Code: "lock_timeout", Message: "Another request with this idempotency key is still being processed; retry with the same key."})
	case errors.Is(err, idem.ErrKeyInvalid), errors.Is(err, idem.ErrKeyMissing):
		writeError(w, http.StatusBadRequest, &PaymentError{Type: "invalid_request_error", Message: "Invalid Idempotency-Key: " + strings.TrimPrefix(err.Error(), "idem: invalid Idempotency-Key: ")})
	case errors.Is(err, idem.ErrRequestTooLarge):
		writeError(w, http.StatusRequestEntityTooLarge, &PaymentError{Type: "invalid_request_error", Message: "The request body is too large."})
	case errors.Is(err, idem.ErrStoreUnavailable):
		w.Header().Set("Stripe-Should-Retry", "true")
		writeError(w, http.StatusInternalServerError, &PaymentError{Type: "api_error", Message: "The idempotency store is unavailable; nothing was charged. Retry with the same key."})
	default:
		writeError(w, http.StatusInternalServerError, &PaymentError{Type: "api_error", Message: "An unknown error occurred; nothing was charged."})
	}
}

const idAlphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

// newID returns prefix followed by n random characters, as Stripe's IDs.
func newID(prefix string, n int) string {
	b := make([]byte, n)
	rand.Read(b)
	for i := range b {
		b[i] = idAlphabet[int(b[i])%len(idAlphabet)]
	}
	return prefix + string(b)
}
