package payments

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

// DefaultLockWait is the default Config.LockWait.
const DefaultLockWait = 2 * time.Second

// DefaultKeyRetention is the default Config.KeyRetention, and how long
// Stripe keeps an idempotency key: 24 hours. A client of an external
// gateway must not count on a key being remembered longer.
const DefaultKeyRetention = 24 * time.Hour

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
	// KeyRetention is how long an idempotency key is kept after its first
	// use: a repeat within it replays the first outcome, and after it the
	// key starts a new operation (Stripe keeps keys for 24 hours). Expired
	// keys are deleted by DeleteExpiredKeys, never while their request
	// runs. An order service's in-process gateway keeps them as long as
	// the service keeps its own keys. Default DefaultKeyRetention (24h).
	KeyRetention time.Duration

	// Latency is added before each charge is made. Default 0.
	Latency time.Duration
	// Hold, if set, is called before each charge is made, after Latency,
	// and the charge waits for it to return: a test holds a charge in
	// flight until it has done what must happen meanwhile, where a fixed
	// Latency would be a race with the machine's speed. Default nil.
	Hold func()
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

// MaxLatency is the bound of Config.Latency for keys kept for retention:
// the lease of a key (idem.DefaultLease plus the latency, and at most half
// the retention, since idem.Middleware wants it shorter than the keys'
// TTL) must outlast the injected latency, or every charge would be fenced
// off at its end.
func MaxLatency(retention time.Duration) time.Duration { return retention / 2 }

// Validate reports the first invalid field of c.
func (c Config) Validate() error {
	switch {
	case c.FailAfterCharge < 0 || c.FailAfterCharge > 1:
		return fmt.Errorf("payments: FailAfterCharge %v is not within 0..1", c.FailAfterCharge)
	case c.DeclineOver < 0:
		return fmt.Errorf("payments: DeclineOver %d is negative", c.DeclineOver)
	case c.Latency < 0:
		return fmt.Errorf("payments: Latency %v is negative", c.Latency)
	case c.KeyRetention < 0:
		return fmt.Errorf("payments: KeyRetention %v is negative", c.KeyRetention)
	case c.Latency >= MaxLatency(cmp.Or(c.KeyRetention, DefaultKeyRetention)):
		return fmt.Errorf("payments: Latency %v is not shorter than %v, half the KeyRetention: a charge must end within its key's lease, which is at most that",
			c.Latency, MaxLatency(cmp.Or(c.KeyRetention, DefaultKeyRetention)))
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
	refund http.Handler // POST /v1/refunds, wrapped

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
	if cfg.KeyRetention == 0 {
		cfg.KeyRetention = DefaultKeyRetention
	}
	s := &Server{cfg: cfg, ledger: cfg.Ledger}
	mw := idem.Middleware(cfg.Store, idem.Options{
		TTL: cfg.KeyRetention,
		// The lease must outlast any attempt, injected latency included;
		// an attempt that outlives it is fenced off and rolled back. The
		// library wants it shorter than the key's retention, which tests
		// and demos shorten to seconds: there it is half the retention.
		Lease:        min(idem.DefaultLease+cfg.Latency, cfg.KeyRetention/2),
		InFlightWait: cfg.LockWait,
		OptionalKey:  true, // as at Stripe
		// Every valid answer is smaller (see params.go), so every one is
		// stored.
		MaxRequestBody: MaxRequestBody,
		MaxStoredBody:  MaxStoredAnswer,
		User:           func(r *http.Request) string { return accountFrom(r.Context()) },
		Fingerprint:    fingerprint,
		StoredHeaders:  []string{"Content-Type", "Original-Request"},
		ErrorHandler:   writeIdemError,
		Metrics:        cfg.Metrics,
		Logger:         cfg.Logger,
	})
	s.create = settled(s.dropAfterCharge(mw(http.HandlerFunc(s.createIntent))))
	s.refund = settled(mw(http.HandlerFunc(s.createRefund)))
	return s
}

// DeleteExpiredKeys deletes up to limit idempotency keys whose retention
// (Config.KeyRetention) has passed, never one whose request is still
// running, and reports how many it deleted. Call it again while it
// deletes limit: CleanExpiredKeys does. It needs a Store that implements
// idemdriver.Sweeper, as memstore, sqlitestore and pgstore do.
func (s *Server) DeleteExpiredKeys(ctx context.Context, limit int) (int, error) {
	sw, ok := s.cfg.Store.(idemdriver.Sweeper)
	if !ok {
		return 0, fmt.Errorf("payments: the idempotency store %T cannot delete expired keys (not an idemdriver.Sweeper)", s.cfg.Store)
	}
	n, err := sw.DeleteExpired(ctx, limit)
	if err != nil {
		return n, fmt.Errorf("payments: deleting expired idempotency keys: %w", err)
	}
	return n, nil
}

// Defaults of CleanOptions.
const (
	DefaultCleanBatch = 500
	DefaultCleanPause = 10 * time.Millisecond
)

// CleanOptions configures CleanExpiredKeys.
type CleanOptions struct {
	// Batch is how many keys one DeleteExpiredKeys call deletes at most.
	// Default DefaultCleanBatch.
	Batch int
	// Pause is the wait between two full batches, so that the cleaner
	// leaves the database to the requests. Default DefaultCleanPause.
	Pause time.Duration
}

// CleanExpiredKeys deletes every expired idempotency key, in batches of
// opts.Batch with opts.Pause between them, until a batch is not full or
// ctx ends, and reports how many it deleted: one sweep of an idem.Cleaner
// of KeySweeper.
func (s *Server) CleanExpiredKeys(ctx context.Context, opts CleanOptions) (int, error) {
	return s.NewCleaner(idem.CleanerOptions{Batch: opts.Batch, Pause: opts.Pause}).RunOnce(ctx)
}

// NewCleaner returns a cleaner of the gateway's expired idempotency keys
// (DeleteExpiredKeys, batch after batch) with opts, whose Batch and Pause
// default to DefaultCleanBatch and DefaultCleanPause. `payments serve`
// runs one, and so does the order service for its in-process gateway.
func (s *Server) NewCleaner(opts idem.CleanerOptions) *idem.Cleaner {
	if opts.Batch <= 0 {
		opts.Batch = DefaultCleanBatch
	}
	if opts.Pause <= 0 {
		opts.Pause = DefaultCleanPause
	}
	return idem.NewCleaner(keySweeper{s}, opts)
}

// keySweeper is the gateway's store as the idemdriver.Sweeper that its cleaner
// sweeps: DeleteExpired is DeleteExpiredKeys, Abandoned the store's.
type keySweeper struct{ s *Server }

func (k keySweeper) DeleteExpired(ctx context.Context, limit int) (int, error) {
	return k.s.DeleteExpiredKeys(ctx, limit)
}

func (k keySweeper) Abandoned(ctx context.Context, p idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	sw, ok := k.s.cfg.Store.(idemdriver.Sweeper)
	if !ok {
		return nil, fmt.Errorf("payments: the idempotency store %T cannot list abandoned keys (not an idemdriver.Sweeper)", k.s.cfg.Store)
	}
	return sw.Abandoned(ctx, p)
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
	case p == "/v1/refunds" && r.Method == http.MethodPost:
		s.refund.ServeHTTP(w, r)
	case p == "/v1/refunds" && r.Method == http.MethodGet:
		s.listRefunds(w, r)
	case p == searchURL && r.Method == http.MethodGet:
		s.searchIntents(w, r) // search.go
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
	var pi *PaymentIntent
	err := fmt.Errorf("%w: %q", ErrNotFound, id)
	// An id that no ledger can keep (not UTF-8, NUL, too long) names
	// nothing: it never reaches the ledger, which might refuse it.
	if checkString("id", id, MaxStringLen) == nil {
		pi, err = s.ledger.Get(r.Context(), accountFrom(r.Context()), id)
	}
	switch {
	case errors.Is(err, ErrNotFound):
		writeError(w, http.StatusNotFound, &PaymentError{Type: "invalid_request_error", Code: "resource_missing", Param: "intent", Message: fmt.Sprintf("No such payment_intent: '%s'", truncate(id, MaxStringLen))})
	case err != nil:
		s.internalError(w, r, "get", err)
	default:
		writeJSON(w, http.StatusOK, pi)
	}
}

// listObject is Stripe's list envelope, of PaymentIntents.
type listObject struct {
	Object  string           `json:"object"`
	Data    []*PaymentIntent `json:"data"`
	HasMore bool             `json:"has_more"`
	URL     string           `json:"url"`
}

// refundList is Stripe's list envelope, of refunds.
type refundList struct {
	Object  string          `json:"object"`
	Data    []*RefundRecord `json:"data"`
	HasMore bool            `json:"has_more"`
	URL     string          `json:"url"`
}

// listQuery is what a list request asks for: a page, and filter, the
// value of the list's filter parameter, if any.
type listQuery struct {
	ListQuery
	filter string
}

// readListQuery reads the query of a list request within the limits
// documented in params.go; filterParam names the list's filter parameter,
// if it has one. On an invalid query it answers 400 and returns false.
func (s *Server) readListQuery(w http.ResponseWriter, r *http.Request, filterParam string) (listQuery, bool) {
	v, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		writeParamError(w, "", "", "Invalid request: the query string is not form-encoded.")
		return listQuery{}, false
	}
	ps := newParams(v)
	q := listQuery{ListQuery: ListQuery{Account: accountFrom(r.Context()), Limit: DefaultListLimit}}
	fail := func(err error) (listQuery, bool) {
		var pe *paramError
		errors.As(err, &pe)
		writeParamError(w, pe.param, pe.code, pe.msg)
		return listQuery{}, false
	}
	if n, ok, err := ps.integer("limit", 1, MaxListLimit); err != nil {
		return fail(err)
	} else if ok {
		q.Limit = int(n)
	}
	if q.StartingAfter, _, err = ps.str("starting_after", MaxStringLen); err != nil {
		return fail(err)
	}
	if q.EndingBefore, _, err = ps.str("ending_before", MaxStringLen); err != nil {
		return fail(err)
	}
	if filterParam != "" {
		if q.filter, _, err = ps.str(filterParam, MaxStringLen); err != nil {
			return fail(err)
		}
	}
	if err := ps.expand(); err != nil {
		return fail(err)
	}
	if err := ps.unknown(); err != nil {
		return fail(err)
	}
	if q.StartingAfter != "" && q.EndingBefore != "" {
		writeParamError(w, "ending_before", "", "You may only specify one of these parameters: ending_before, starting_after.")
		return listQuery{}, false
	}
	return q, true
}

// writeCursorMissing answers a list whose cursor names no object.
func (q listQuery) writeCursorMissing(w http.ResponseWriter, object string) {
	param, id := "starting_after", q.StartingAfter
	if q.EndingBefore != "" {
		param, id = "ending_before", q.EndingBefore
	}
	writeParamError(w, param, "resource_missing", fmt.Sprintf("No such %s: '%s'", object, id))
}

func (s *Server) listIntents(w http.ResponseWriter, r *http.Request) {
	q, ok := s.readListQuery(w, r, "")
	if !ok {
		return
	}
	p, err := s.ledger.List(r.Context(), q.ListQuery)
	switch {
	case errors.Is(err, ErrNotFound):
		q.writeCursorMissing(w, "payment_intent")
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

// readForm reads the form parameters of a POST, from its query and its
// form-encoded body of at most MaxRequestBody bytes. On an error it
// answers and returns false.
func (s *Server) readForm(w http.ResponseWriter, r *http.Request) (url.Values, bool) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, MaxRequestBody))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			writeError(w, http.StatusRequestEntityTooLarge, &PaymentError{Type: "invalid_request_error", Message: "The request body is too large."})
			return nil, false
		}
		writeError(w, http.StatusBadRequest, &PaymentError{Type: "invalid_request_error", Message: "Could not read the request body."})
		return nil, false
	}
	v, err := requestParams(r, body)
	if err != nil {
		var pe *paramError
		errors.As(err, &pe)
		writeParamError(w, pe.param, pe.code, pe.msg)
		return nil, false
	}
	return v, true
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
	case errors.Is(err, idem.ErrBadBody), errors.Is(err, idem.ErrBadTarget):
		writeError(w, http.StatusBadRequest, &PaymentError{Type: "invalid_request_error", Message: "The request could not be read: " + err.Error()})
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
