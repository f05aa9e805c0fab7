package idem

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/idem-go/idem/problem"
)

// Options configures Middleware. The zero value is usable: every field
// documents its default, which a zero value stands for. Middleware
// refuses (panics on) a negative duration or size and a header list entry
// that is not a header field name.
type Options struct {
	// TTL is how long a key lives after its first use. Default DefaultTTL (24h).
	TTL time.Duration
	// Lease is how long one attempt holds a key exclusively; it must be
	// longer than any request may run. Default DefaultLease (30s).
	Lease time.Duration
	// InFlightWait is how long a repeat waits for a running attempt to
	// finish before it is answered with ErrInFlight (409). Default 0: at once.
	InFlightWait time.Duration
	// OptionalKey lets requests without an Idempotency-Key through,
	// unprotected. Default false: a missing key is ErrKeyMissing (400).
	OptionalKey bool
	// User returns the scope of a key: the same key from two users names two
	// operations. Required by Middleware, which has no default: a key
	// space shared by every caller lets anyone who sends another caller's
	// key and body replay that caller's answer. Return the authenticated
	// caller (never a value the client chooses unchecked); SharedKeySpace
	// is the explicit choice of one key space for everybody.
	User func(r *http.Request) string
	// MaxRequestBody bounds the request body read for the fingerprint.
	// Default DefaultMaxRequestBody (1 MiB); a larger body is ErrRequestTooLarge (413).
	MaxRequestBody int64
	// MaxStoredBody bounds what is kept for replay: the response body with
	// its kept headers and trailers. Default DefaultMaxStoredBody (1 MiB).
	// A larger answer to a request whose work
	// commits is still given in full to its caller, and the key is never
	// released: the outcome is stored as a problem of type
	// problem.ResponseNotStored (application/problem+json) with the
	// original status, the kept headers (such as Location) and an
	// "original_status" member, and every replay answers that, so that
	// the request is never run a second time.
	MaxStoredBody int64
	// Stored decides which statuses are final outcomes, stored and replayed.
	// Default StoredStatus: 2xx, 3xx and 402.
	Stored func(status int) bool
	// StoredHeaders are the response headers kept for replay, so that a
	// replay is the same answer. Default DefaultStoredHeaders(): every
	// header that describes the body or its caching (Content-Type,
	// Content-Encoding, Content-Language, Content-Location,
	// Content-Disposition, Content-Range, Content-Digest, Repr-Digest,
	// ETag, Last-Modified, Cache-Control, Expires, Vary) and Location,
	// Link and Retry-After. Whatever the list, these are never kept:
	// Set-Cookie (it belongs to the first client), Content-Length (a
	// replay sets it from the body), the hop-by-hop headers (Connection,
	// those the Connection header names, Keep-Alive, Proxy-*, TE,
	// Trailer, Transfer-Encoding, Upgrade) and the middleware's own
	// Idempotency-Key and Idempotent-Replayed. Trailers are kept apart
	// from this list: every trailer the handler declares (in the Trailer
	// header, its value set after the body, or with http.TrailerPrefix)
	// is stored in Response.Trailer and replayed as a trailer.
	StoredHeaders []string
	// KeptRequestHeaders are the request headers kept with the claim so an
	// abandoned request can be finished later. Default Content-Type.
	KeptRequestHeaders []string
	// Fingerprint identifies the request behind a key. Default Fingerprint:
	// method, path, query string (its parameters sorted by name and
	// percent-decoded) and canonical JSON body; it refuses (ErrBadBody,
	// 400) a JSON body that repeats a member name in one object, exactly
	// or differing only in case. FingerprintWithoutQuery leaves the query
	// out, for handlers that read none (so that an added tracking
	// parameter does not make a retry another request). An error is
	// answered through ErrorHandler before the key is claimed; wrap
	// ErrBadBody for a 400.
	Fingerprint func(r *http.Request, body []byte) (string, error)
	// ErrorHandler writes the answer for the middleware's own errors:
	// ErrKeyMissing, ErrKeyInvalid, ErrBadBody, ErrRequestTooLarge,
	// ErrFingerprintMismatch, ErrInFlight, ErrFenced (this attempt lost its
	// lease), ErrStoreUnavailable and ErrHandlerPanicked. Default
	// WriteError: RFC 9457 problem details.
	ErrorHandler func(w http.ResponseWriter, r *http.Request, err error)
	// Metrics, if set, counts outcomes.
	Metrics *Metrics
	// Logger receives store failures that do not change the answer.
	// Default slog.Default().
	Logger *slog.Logger
	// Now is the middleware's clock, as the stores' Now is theirs.
	// Default time.Now. It decides when InFlightWait runs out, and the
	// default ErrorHandler's Retry-After for ErrInFlight, which compares
	// it with the holder's lease end (InFlightError.LeaseUntil, set by
	// the store's clock: give both the same clock). A clock that stands
	// still makes InFlightWait last until the holder is done or the
	// client leaves. Timeouts and pauses of store calls (the 10 s bound
	// of a claim call, the pauses before sending a failed call again)
	// are waits on the real clock, as context deadlines are, and do not
	// read it. Leases and expiries are the store's clock.
	Now func() time.Time
}

// storedBody is what a claim keeps of a request's body for the completer
// to run the request again: a JSON body without its insignificant white
// space (a client may pad a body up to MaxRequestBody with it; a JSON
// decoder reads the same value either way), any other body as it came.
// The stores drop it when the key completes.
func storedBody(body []byte) []byte {
	if len(body) == 0 || !bytes.ContainsAny(body, " \t\r\n") {
		return body
	}
	var b bytes.Buffer
	if err := json.Compact(&b, body); err != nil {
		return body
	}
	return b.Bytes()
}

// SharedKeySpace is an Options.User for a service whose callers all share
// one key space: the same Idempotency-Key from any two callers names one
// operation, and a caller who sends another's key and body is answered
// with the other's stored response. Use it only where there is one caller
// (a single internal client), or where the key itself is a secret no
// other caller can know; anywhere else, give Options.User the function
// that names the authenticated caller.
func SharedKeySpace(*http.Request) string { return "" }

// StoredStatus is the default Options.Stored: 2xx, 3xx and 402 Payment
// Required, a declined payment being a final outcome.
func StoredStatus(status int) bool {
	return (status >= 200 && status < 400) || status == http.StatusPaymentRequired
}

// DefaultStoredHeaders returns the default Options.StoredHeaders, a new
// slice each time: append to it to keep more.
func DefaultStoredHeaders() []string {
	return []string{
		// The representation: what the body is and how to read it.
		"Content-Type", "Content-Encoding", "Content-Language", "Content-Location",
		"Content-Disposition", "Content-Range", "Content-Digest", "Repr-Digest",
		// Validators and caching.
		"ETag", "Last-Modified", "Cache-Control", "Expires", "Vary",
		// Where to go next.
		"Location", "Link", "Retry-After",
	}
}

// neverStored reports whether the response header (or trailer) k, in
// canonical form, is never kept for replay, whatever Options.StoredHeaders
// says: see there. connection holds the Connection header's values.
func neverStored(k string, connection []string) bool {
	switch k {
	case "Set-Cookie", "Content-Length", "Connection", "Keep-Alive", "Te", "Trailer",
		"Transfer-Encoding", "Upgrade", "Idempotency-Key", "Idempotent-Replayed":
		return true
	}
	if strings.HasPrefix(k, "Proxy-") || strings.HasPrefix(k, http.TrailerPrefix) {
		return true
	}
	for _, v := range connection {
		for _, n := range strings.Split(v, ",") {
			if http.CanonicalHeaderKey(strings.TrimSpace(n)) == k {
				return true
			}
		}
	}
	return false
}

// storedTrailers is the part of the trailers t that is kept for replay:
// all but those never stored; nil if none is left.
func storedTrailers(t http.Header, connection []string) http.Header {
	var out http.Header
	for k, v := range t {
		if len(v) > 0 && !neverStored(k, connection) {
			if out == nil {
				out = make(http.Header, len(t))
			}
			out[k] = append([]string(nil), v...)
		}
	}
	return out
}

// storedHeaders is the part of a response header h that is kept for
// replay: the names listed (stored holds them in canonical form), less
// those never stored. The map is new; the value slices are h's.
func storedHeaders(h http.Header, stored map[string]struct{}) http.Header {
	out := make(http.Header)
	conn := h.Values("Connection")
	for k, v := range h {
		if _, ok := stored[k]; ok && len(v) > 0 && !neverStored(k, conn) {
			out[k] = v
		}
	}
	return out
}

// Metrics counts what the middleware did. All fields are safe for
// concurrent use; read them with Load.
type Metrics struct {
	Executions   atomic.Int64 // handler runs under a claimed key
	Completed    atomic.Int64 // outcomes committed and stored
	Replays      atomic.Int64 // answers replayed from the store
	Conflicts    atomic.Int64 // 409 answers: in flight
	Mismatches   atomic.Int64 // 422 answers: other fingerprint
	Released     atomic.Int64 // keys freed after a refused (4xx) first attempt
	Failed       atomic.Int64 // 5xx answers, panics and 4xx after a first attempt: key kept
	Fenced       atomic.Int64 // attempts refused at commit: lease lost
	StoreErrors  atomic.Int64 // store calls that failed
	Unprotected  atomic.Int64 // requests let through without a key
	Invalid      atomic.Int64 // requests refused for a missing or bad key
	OversizeBody atomic.Int64 // answers too large to store: replays get problem.ResponseNotStored
	StoreRetries atomic.Int64 // store calls sent again after an error
	GivenUp      atomic.Int64 // keys a completer re-drove for the last time without an outcome
}

// WriteError is the default Options.ErrorHandler: problem details
// (ProblemFor), with Retry-After on its 409 and 503 answers. Called as a
// function it reads time.Now; the default ErrorHandler reads Options.Now.
func WriteError(w http.ResponseWriter, r *http.Request, err error) {
	writeError(w, err, time.Now)
}

// writeError is WriteError with the clock now.
func writeError(w http.ResponseWriter, err error, now func() time.Time) {
	p := ProblemFor(err)
	if p.Status == http.StatusConflict || p.Status == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds(err, now)))
	}
	problem.Write(w, p)
}

// retryAfterSeconds is the Retry-After advised for err: one second, which a
// request that is still running is most likely done by; never more than the
// rest of the lease at now, rounded up.
func retryAfterSeconds(err error, now func() time.Time) int {
	var ife *InFlightError
	if errors.As(err, &ife) {
		left := ife.LeaseUntil.Sub(now()).Seconds()
		if left > 0 && left < 1 {
			return int(math.Ceil(left))
		}
	}
	return 1
}

type ctxKey struct{}

// requestState is what the middleware (and Do) puts in the context of the
// work it runs under a lease: the lease and the transaction begun on first
// use.
type requestState struct {
	p        *protocol
	lease    *Lease
	beginCtx context.Context // the request's context without its cancellation

	mu      sync.Mutex // guards tx, err and settled
	tx      Tx
	err     error
	settled bool // the outcome is settled: no transaction may begin
}

func (s *requestState) get() (Tx, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.settled && s.tx == nil {
		return nil, ErrSettled
	}
	if s.tx == nil && s.err == nil {
		// Begin opens a transaction and nothing else: safe to send again.
		s.err = s.p.retryDetached(s.beginCtx, "begin", func(ctx context.Context) error {
			var err error
			s.tx, err = s.p.store.Begin(ctx, s.lease)
			return err
		})
		if s.err != nil {
			s.tx = nil
		}
	}
	return s.tx, s.err
}

// rollback discards the transaction, if any, and settles the request: a
// goroutine the handler left behind can no longer begin one, which would
// stay open for ever.
func (s *requestState) rollback() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.settled = true
	if s.tx != nil {
		s.tx.Rollback(s.beginCtx)
	}
}

// TxFromContext returns the transaction of the claimed request (or Do
// operation) that ctx belongs to, beginning it on first use: a handler
// that calls another service first holds no transaction while it waits.
// Outside a claimed request it returns ErrNoTx; once the request was
// answered without one (from a goroutine the handler left running),
// ErrSettled.
//
// The middleware owns the transaction: it commits the handler's writes
// with the stored answer (Complete), or rolls them back, once the
// handler returned. The Tx returned here is the handler's view of it:
// its Complete and Rollback refuse with an error matching ErrTxOwned and
// change nothing. Its Unwrap returns the store's own transaction, which
// the stores' FromContext accessors turn into their handles (see
// UnwrapTx); those refuse to commit or roll back as well.
func TxFromContext(ctx context.Context) (Tx, error) {
	s, ok := ctx.Value(ctxKey{}).(*requestState)
	if !ok {
		return nil, ErrNoTx
	}
	if _, err := s.get(); err != nil {
		return nil, err
	}
	return handlerTx{s}, nil
}

// LeaseFromContext returns the lease of the claimed request (or Do
// operation) that ctx belongs to.
func LeaseFromContext(ctx context.Context) (*Lease, bool) {
	s, ok := ctx.Value(ctxKey{}).(*requestState)
	if !ok {
		return nil, false
	}
	return s.lease, true
}

// Middleware returns middleware that makes the wrapped handler idempotent
// with store. Requests with safe methods (GET, HEAD, OPTIONS, TRACE) pass
// through untouched.
//
// Middleware checks its arguments when it is called, not on the first
// request, and panics with a message naming what is wrong: a nil store,
// a nil Options.User (there is no default scope: give the function that
// names the caller, or SharedKeySpace on purpose), a negative Options.TTL, Lease, InFlightWait, MaxRequestBody or
// MaxStoredBody, or an entry of Options.StoredHeaders or
// KeptRequestHeaders that is not a header field name (an RFC 9110
// token). Zero values and nil funcs take their defaults.
func Middleware(store Store, opts Options) func(http.Handler) http.Handler {
	if store == nil {
		panic("idem.Middleware: nil Store")
	}
	if opts.User == nil {
		panic("idem.Middleware: Options.User is nil: give the function that names the caller (a key belongs to one user: " +
			"without it, anyone who sends another caller's key and body gets that caller's stored answer), or idem.SharedKeySpace " +
			"to let every caller share one key space on purpose")
	}
	if err := opts.check(); err != nil {
		panic("idem.Middleware: " + err.Error())
	}
	m := newMiddleware(store, opts.withDefaults())
	m.headerNames() // read the header lists once, before any request
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			m.serve(w, r, next)
		})
	}
}

// check returns an error naming the first field of o that Middleware
// refuses, or nil.
func (o *Options) check() error {
	for _, d := range [...]struct {
		name string
		v    time.Duration
	}{{"TTL", o.TTL}, {"Lease", o.Lease}, {"InFlightWait", o.InFlightWait}} {
		if d.v < 0 {
			return fmt.Errorf("invalid Options.%s %v: negative (zero means the default)", d.name, d.v)
		}
	}
	if o.MaxRequestBody < 0 {
		return fmt.Errorf("invalid Options.MaxRequestBody %d: negative (zero means the default)", o.MaxRequestBody)
	}
	if o.MaxStoredBody < 0 {
		return fmt.Errorf("invalid Options.MaxStoredBody %d: negative (zero means the default)", o.MaxStoredBody)
	}
	for i, n := range o.StoredHeaders {
		if !headerName(n) {
			return fmt.Errorf("invalid Options.StoredHeaders[%d] %q: not a header field name", i, n)
		}
	}
	for i, n := range o.KeptRequestHeaders {
		if !headerName(n) {
			return fmt.Errorf("invalid Options.KeptRequestHeaders[%d] %q: not a header field name", i, n)
		}
	}
	return nil
}

// headerName reports whether s is a header field name: an RFC 9110
// token.
func headerName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

func (o Options) withDefaults() Options {
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.TTL <= 0 {
		o.TTL = DefaultTTL
	}
	if o.Lease <= 0 {
		o.Lease = DefaultLease
	}
	if o.User == nil {
		o.User = func(*http.Request) string { return "" }
	}
	if o.MaxRequestBody <= 0 {
		o.MaxRequestBody = DefaultMaxRequestBody
	}
	if o.MaxStoredBody <= 0 {
		o.MaxStoredBody = DefaultMaxStoredBody
	}
	if o.Stored == nil {
		o.Stored = StoredStatus
	}
	if o.StoredHeaders == nil {
		o.StoredHeaders = DefaultStoredHeaders()
	}
	if o.KeptRequestHeaders == nil {
		o.KeptRequestHeaders = []string{"Content-Type"}
	}
	if o.Fingerprint == nil {
		o.Fingerprint = Fingerprint
	}
	if o.ErrorHandler == nil {
		now := o.Now
		o.ErrorHandler = func(w http.ResponseWriter, _ *http.Request, err error) { writeError(w, err, now) }
	}
	if o.Metrics == nil {
		o.Metrics = new(Metrics)
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return o
}

type middleware struct {
	protocol // the claim, Begin, Complete, Fail and Release: Do's too
	opts     Options

	namesOnce sync.Once
	kept      []string            // KeptRequestHeaders, canonical, without repeats
	stored    map[string]struct{} // StoredHeaders, canonical

	// lastKept holds the http.Header of kept request headers last made
	// (see keptHeaders): its values are its own, and nothing changes it.
	lastKept atomic.Value
}

// newMiddleware returns the middleware of store with opts, whose defaults
// are set (Options.withDefaults).
func newMiddleware(store Store, opts Options) *middleware {
	return &middleware{
		protocol: protocol{store: store, inFlightWait: opts.InFlightWait, now: opts.Now, metrics: opts.Metrics, logger: opts.Logger},
		opts:     opts,
	}
}

// headerNames returns the canonical forms of Options.KeptRequestHeaders
// and Options.StoredHeaders, computed on first use (Middleware does it
// when it is built, so the lists are read once, as given then).
func (m *middleware) headerNames() (kept []string, stored map[string]struct{}) {
	m.namesOnce.Do(func() {
		for _, n := range m.opts.KeptRequestHeaders {
			if c := http.CanonicalHeaderKey(n); !slices.Contains(m.kept, c) {
				m.kept = append(m.kept, c)
			}
		}
		m.stored = make(map[string]struct{}, len(m.opts.StoredHeaders))
		for _, n := range m.opts.StoredHeaders {
			m.stored[http.CanonicalHeaderKey(n)] = struct{}{}
		}
	})
	return m.kept, m.stored
}

// exchange is the memory one keyed request needs, allocated at once: the
// values of the headers the middleware sets, the first claim's context,
// the body handed to the handler, and, for a request that runs, its
// state, context, recorder and the response given to the store. It lives
// as long as the request and whatever keeps a part of it (the answer's
// header values, the handler's context).
type exchange struct {
	// vals backs the header values the middleware sets on the answer:
	// [0] the echoed Idempotency-Key, [1] Idempotent-Replayed, [2]
	// Content-Length. Each is handed out as a one-value slice whose
	// capacity ends at its value, so an append by anyone copies.
	vals     [3]string
	dctx     detachedCtx // the request's context without its cancellation
	claimCtx callCtx     // the context of the first claim call
	body     bodyReader  // r.Body for the handler: the body read for the fingerprint
	// room holds the request body and then the recorded answer's, when
	// they fit.
	room [exchangeRoom]byte

	st   requestState
	sctx stateCtx
	rec  recorder
	resp Response // the response given to the store's Complete
}

// exchangeRoom is the room for bodies in an exchange: a small request
// and its answer fit.
const exchangeRoom = 512

// header sets h[k] to the single value v, stored in x.vals[i]: Header.Set
// without its allocation. k must be canonical.
func (x *exchange) header(h http.Header, i int, k, v string) {
	x.vals[i] = v
	h[k] = x.vals[i : i+1 : i+1]
}

// bodyReader is the request body handed to the handler once it was read
// for the fingerprint: io.NopCloser(bytes.NewReader(body)) in one value,
// with the same methods (Read, WriteTo, Close).
type bodyReader struct{ r bytes.Reader }

func (b *bodyReader) Read(p []byte) (int, error)         { return b.r.Read(p) }
func (b *bodyReader) WriteTo(w io.Writer) (int64, error) { return b.r.WriteTo(w) }
func (*bodyReader) Close() error                         { return nil }

// stateCtx is the handler's context: the request's context with the
// request's state under ctxKey{}, as context.WithValue would make it,
// without an allocation of its own. Every other key, and the
// cancellation, are the request context's (context.WithCancel and
// context.Cause on it find the request's cancellation as through
// context.WithValue).
type stateCtx struct {
	context.Context
	st *requestState
}

func (c *stateCtx) Value(key any) any {
	if _, ok := key.(ctxKey); ok {
		return c.st
	}
	return c.Context.Value(key)
}

// detachedCtx is context.WithoutCancel(parent), made only when a value is
// asked for: no deadline, no cancellation, and parent's values (through
// a context.WithoutCancel of it, so that context.Cause finds no
// cancellation either).
type detachedCtx struct {
	parent context.Context

	mu  sync.Mutex
	ctx context.Context // context.WithoutCancel(parent), once made
}

func (*detachedCtx) Deadline() (time.Time, bool) { return time.Time{}, false }
func (*detachedCtx) Done() <-chan struct{}       { return nil }
func (*detachedCtx) Err() error                  { return nil }

func (c *detachedCtx) Value(key any) any {
	c.mu.Lock()
	if c.ctx == nil {
		c.ctx = context.WithoutCancel(c.parent)
	}
	ctx := c.ctx
	c.mu.Unlock()
	return ctx.Value(key)
}

// callCtx is the context of one claim call: parent, which has no
// cancellation and no deadline (the request's context.WithoutCancel),
// with deadline as its deadline, ended by stop when the call returns.
// It behaves as context.WithDeadline(parent, deadline) with its cancel
// function called by stop, and it is one: the first call of Done (or of
// Value once Done was called) makes it, with its timer. A store that only
// asks Err (memstore) makes neither; Err compares the clock with the
// deadline instead.
type callCtx struct {
	parent   context.Context
	deadline time.Time

	mu     sync.Mutex
	ctx    context.Context    // context.WithDeadline(parent, deadline), once made
	cancel context.CancelFunc // ctx's
	err    error              // before ctx is made: context.Canceled once stopped, DeadlineExceeded once past
}

func (c *callCtx) init(parent context.Context, timeout time.Duration) {
	c.parent, c.deadline = parent, time.Now().Add(timeout)
}

func (c *callCtx) Deadline() (time.Time, bool) { return c.deadline, true }

func (c *callCtx) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx == nil {
		if errors.Is(c.err, context.Canceled) {
			// Stopped before: its error stays Canceled, even past the
			// deadline.
			c.ctx, c.cancel = context.WithCancel(c.parent)
			c.cancel()
		} else {
			c.ctx, c.cancel = context.WithDeadline(c.parent, c.deadline)
		}
	}
	return c.ctx.Done()
}

func (c *callCtx) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx != nil {
		return c.ctx.Err()
	}
	if c.err == nil && !time.Now().Before(c.deadline) {
		c.err = context.DeadlineExceeded
	}
	return c.err
}

// Value is the parent's, or once Done made the context, that context's
// (so that a context derived from c and context.Cause find c's
// cancellation, as they would on context.WithDeadline's).
func (c *callCtx) Value(key any) any {
	c.mu.Lock()
	ctx := c.ctx
	c.mu.Unlock()
	if ctx != nil {
		return ctx.Value(key)
	}
	return c.parent.Value(key)
}

// stop ends c when its call returned, as WithDeadline's cancel function.
func (c *callCtx) stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx != nil {
		c.cancel()
		return
	}
	if c.err == nil {
		if time.Now().Before(c.deadline) {
			c.err = context.Canceled
		} else {
			c.err = context.DeadlineExceeded
		}
	}
}

func (m *middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		next.ServeHTTP(w, r)
		return
	}
	o := &m.opts
	raw := r.Header.Values("Idempotency-Key")
	if len(raw) == 0 {
		if o.OptionalKey {
			o.Metrics.Unprotected.Add(1)
			next.ServeHTTP(w, r)
			return
		}
		o.Metrics.Invalid.Add(1)
		o.ErrorHandler(w, r, ErrKeyMissing)
		return
	}
	x := new(exchange)
	x.header(w.Header(), 0, "Idempotency-Key", raw[0])
	if len(raw) > 1 {
		o.Metrics.Invalid.Add(1)
		o.ErrorHandler(w, r, fmt.Errorf("%w: more than one Idempotency-Key header", ErrKeyInvalid))
		return
	}
	key, err := ParseKey(raw[0])
	if err != nil {
		o.Metrics.Invalid.Add(1)
		o.ErrorHandler(w, r, err)
		return
	}
	if !utf8.ValidString(r.URL.RequestURI()) {
		o.ErrorHandler(w, r, ErrBadTarget)
		return
	}
	body, err := readBody(r, o.MaxRequestBody, x.room[:])
	if err != nil {
		o.ErrorHandler(w, r, err)
		return
	}
	p := ClaimParams{
		User:   o.User(r),
		Key:    key,
		Owner:  NewOwner(),
		Method: r.Method,
		Path:   r.URL.RequestURI(),
		Header: m.keptHeaders(r.Header),
		Body:   storedBody(body),
		Lease:  o.Lease,
		TTL:    o.TTL,
	}
	if rd := redriveOf(r.Context()); rd != nil {
		// A completer's re-drive: the claim is the one it already made.
		p.Fingerprint, p.Owner, p.Redrive = rd.fingerprint, rd.owner, rd.params
	} else if p.Fingerprint, err = o.Fingerprint(r, body); err != nil {
		o.ErrorHandler(w, r, err)
		return
	}
	// The claim does not follow the client's cancellation: a claim that
	// committed but whose answer was lost would hold the key, unrun, for a
	// whole lease. Once claimed, the request runs even if the client left,
	// and its outcome is stored for the retry.
	x.dctx.parent = r.Context()
	dctx := &x.dctx
	c, err := m.claimFrom(r.Context(), dctx, p, &x.claimCtx)
	if err != nil {
		o.ErrorHandler(w, r, m.claimFailed(r.Context(), &p, err))
		return
	}
	if c.Response != nil {
		o.Metrics.Replays.Add(1)
		x.replay(w, c.Response)
		return
	}
	x.body.r.Reset(body)
	r.Body = &x.body
	r.ContentLength = int64(len(body))
	m.execute(w, r, next, c.Lease, body, dctx, x)
}

// protocol is the part of the middleware that Do shares: the state
// machine of one attempt at a key, without HTTP. It claims the key (with
// an owner token, store calls sent again after an error, waiting while
// another attempt holds it), begins the attempt's transaction on first
// use (requestState), commits the outcome in that transaction fenced on
// the owner (complete), or ends the attempt keeping the key bound (abort,
// fail) or frees the key (release), and counts and logs each step.
type protocol struct {
	store        Store
	inFlightWait time.Duration    // Options.InFlightWait, DoParams.InFlightWait
	now          func() time.Time // Options.Now; time.Now for Do
	metrics      *Metrics         // never nil
	logger       *slog.Logger     // never nil
}

// claimTimeout bounds one claim, which does not end with the client's request.
const claimTimeout = 10 * time.Second

// claim claims p, waiting up to InFlightWait while another attempt holds
// it, unless the client's request (rctx) ends first. Each store call runs
// apart from the client's cancellation, bounded by claimTimeout, and is
// sent again after an error (see retry): p.Owner makes that safe.
func (m *protocol) claim(rctx context.Context, p ClaimParams) (Claim, error) {
	return m.claimFrom(rctx, context.WithoutCancel(rctx), p, nil)
}

// claimFrom is claim with dctx, rctx without its cancellation, made by
// the caller; first, if not nil, is the context of the first store call
// (later calls get new ones).
func (m *protocol) claimFrom(rctx, dctx context.Context, p ClaimParams, first *callCtx) (Claim, error) {
	var deadline time.Time
	if m.inFlightWait > 0 {
		deadline = m.now().Add(m.inFlightWait)
	}
	pause := 5 * time.Millisecond
	for {
		var c Claim
		err := m.retryDetached(dctx, "claim", func(ctx context.Context) error {
			cc := first
			if cc == nil {
				cc = new(callCtx)
			}
			first = nil
			cc.init(ctx, claimTimeout)
			defer cc.stop()
			var err error
			c, err = m.store.Claim(cc, p)
			return err
		})
		if !errors.Is(err, ErrInFlight) || m.inFlightWait <= 0 {
			return c, err
		}
		left := deadline.Sub(m.now())
		if left <= 0 {
			return c, err
		}
		t := time.NewTimer(min(pause, left))
		select {
		case <-rctx.Done():
			t.Stop()
			return c, err
		case <-t.C:
		}
		pause = min(2*pause, 100*time.Millisecond)
	}
}

// claimFailed counts the claim of p that failed with err and returns the
// error to report: the protocol's answers (ErrInFlight,
// ErrFingerprintMismatch, ErrNotDue) as they are, any other logged and
// wrapped in ErrStoreUnavailable.
func (m *protocol) claimFailed(ctx context.Context, p *ClaimParams, err error) error {
	switch {
	case errors.Is(err, ErrInFlight):
		m.metrics.Conflicts.Add(1)
	case errors.Is(err, ErrFingerprintMismatch):
		m.metrics.Mismatches.Add(1)
	case errors.Is(err, ErrNotDue): // a completer's stale re-drive
	default:
		m.metrics.StoreErrors.Add(1)
		logRepeated(ctx, m.logger, slog.LevelError, "idem: claim failed", err, "user", p.User, "key_id", KeyID(p.User, p.Key))
		return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
	}
	return err
}

// start counts an attempt run under lease l and sets st, its state, for
// it: bctx, the caller's context without its cancellation, is where the
// attempt's store calls run. The caller puts st in the work's context
// (stateCtx) and defers st.rollback.
func (m *protocol) start(st *requestState, l *Lease, bctx context.Context) {
	m.metrics.Executions.Add(1)
	*st = requestState{p: m, lease: l, beginCtx: bctx}
}

// outcomeTx returns the transaction in which st's outcome commits: the
// one the work began, or a new one (an outcome is committed even when the
// work wrote nothing). When it cannot be begun, the attempt is ended (the
// key stays bound) and the error to report wraps ErrStoreUnavailable.
func (m *protocol) outcomeTx(st *requestState) (Tx, error) {
	tx, err := st.get()
	if err != nil {
		m.metrics.StoreErrors.Add(1)
		m.fail(st.beginCtx, st.lease)
		return nil, fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
	}
	return tx, nil
}

// completeFailuresAtOnce is how many attempts of a key whose completion
// failed end their lease at once (Fail), so that a retry runs again
// without waiting: after a blip, the first retry succeeds. From the
// attempt after them on, a failed completion keeps its lease until the
// lease ends, as a crash would: a store that refuses every completion
// for the same reason (a setting of the database, a full disk) then runs
// each key once per lease, not once per client retry (thousands of times
// a minute, each one paying anew and rolling back), and the retries
// meanwhile get 409 with the lease's Retry-After.
const completeFailuresAtOnce = 2

// complete commits resp with the work in tx (outcomeTx's), fenced on st's
// lease. It returns ErrFenced when another attempt took the key over (the
// work rolled back), or, when the store failed, an error wrapping
// ErrStoreUnavailable once the attempt is ended (see
// completeFailuresAtOnce).
func (m *protocol) complete(st *requestState, tx Tx, resp *Response) error {
	switch err := tx.Complete(st.beginCtx, resp); {
	case errors.Is(err, ErrFenced):
		m.metrics.Fenced.Add(1)
		return err
	case err != nil:
		l := st.lease
		m.metrics.StoreErrors.Add(1)
		logRepeated(st.beginCtx, m.logger, slog.LevelError, "idem: complete failed", err,
			"user", l.User, "operation", OperationID(l.User, l.Key, l.CreatedAt), "attempt", l.Attempt)
		if l.Attempt <= completeFailuresAtOnce {
			m.fail(st.beginCtx, l)
		}
		return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
	}
	m.metrics.Completed.Add(1)
	return nil
}

// abort discards st's work and ends its attempt, keeping the key bound to
// its fingerprint: the same operation may run again at once.
func (m *protocol) abort(st *requestState) {
	st.rollback()
	m.fail(st.beginCtx, st.lease)
}

// release discards st's work and frees its key, for an operation that
// was refused before anything happened.
func (m *protocol) release(st *requestState) {
	st.rollback()
	m.metrics.Released.Add(1)
	l := st.lease
	err := m.retryDetached(st.beginCtx, "release", func(ctx context.Context) error { return m.store.Release(ctx, l) })
	if err != nil && !errors.Is(err, ErrFenced) {
		m.metrics.StoreErrors.Add(1)
		m.logger.WarnContext(st.beginCtx, "idem: release failed", "user", l.User, "operation", OperationID(l.User, l.Key, l.CreatedAt), "err", err)
	}
}

// replay writes a stored response with Idempotent-Replayed: true, its
// Content-Length from the body, and its trailers, if any, as trailers
// (declared in the Trailer header, without a Content-Length, so that
// HTTP/1.1 sends them after a chunked body). resp is the store's answer
// to this request's claim: a Response of its own (see Store.Claim), whose
// header and trailer values are handed to w as they are instead of
// copied, and the values the middleware sets are kept in x.
func (x *exchange) replay(w http.ResponseWriter, resp *Response) {
	h := w.Header()
	for k, v := range resp.Header {
		h[k] = v
	}
	x.header(h, 1, "Idempotent-Replayed", "true")
	if len(resp.Trailer) == 0 {
		x.header(h, 2, "Content-Length", strconv.Itoa(len(resp.Body)))
	}
	writeTrailers(w, resp.Status, resp.Body, resp.Trailer, false)
}

// writeWithTrailers writes status and body to w, whose header is set,
// then trailer as trailers, declared before the status.
func writeWithTrailers(w http.ResponseWriter, status int, body []byte, trailer http.Header) {
	writeTrailers(w, status, body, trailer, true)
}

// writeTrailers is writeWithTrailers; with copyValues false, the
// trailers' value slices are handed to w as they are.
func writeTrailers(w http.ResponseWriter, status int, body []byte, trailer http.Header, copyValues bool) {
	h := w.Header()
	if len(trailer) > 0 {
		names := slices.Sorted(maps.Keys(trailer))
		h.Set("Trailer", strings.Join(names, ", "))
	}
	w.WriteHeader(status)
	w.Write(body)
	for k, v := range trailer {
		if copyValues {
			v = append([]string(nil), v...)
		}
		h[k] = v
	}
}

// execute runs next under lease l and settles the outcome.
// body is the request body read; bctx is the request's context without
// its cancellation; x holds the request's state, context and recorder.
func (m *middleware) execute(w http.ResponseWriter, r *http.Request, next http.Handler, l *Lease, body []byte, bctx context.Context, x *exchange) {
	o := &m.opts
	st := &x.st
	m.start(st, l, bctx)
	defer st.rollback() // a no-op after Complete; settles the request
	rec := &x.rec
	rec.header = make(http.Header)
	if len(body) <= len(x.room) && (len(body) == 0 || &body[0] == &x.room[0]) {
		rec.room = x.room[len(body):] // the room the request body left
	}
	x.sctx = stateCtx{Context: r.Context(), st: st}
	panicked, abort := runHandler(next, rec, r.WithContext(&x.sctx), o.Logger)

	status := rec.statusCode()
	switch {
	case panicked:
		m.abort(st)
		if abort {
			panic(http.ErrAbortHandler)
		}
		o.ErrorHandler(w, r, ErrHandlerPanicked)
	case o.Stored(status):
		tx, err := m.outcomeTx(st)
		if err != nil {
			o.ErrorHandler(w, r, err)
			return
		}
		header, trailer := rec.split()
		_, stored := m.headerNames()
		// The header values and the body are the recorder's, not copies:
		// the store copies what it keeps (Tx.Complete), and nothing
		// writes them before the answer is sent.
		x.resp = Response{Status: status, Header: storedHeaders(header, stored), Body: rec.body,
			Trailer: storedTrailers(trailer, header.Values("Connection"))}
		resp := &x.resp
		if storedSize(resp) > o.MaxStoredBody || !keepableHeaders(resp.Header) || !keepableHeaders(resp.Trailer) {
			// The work commits, so the key must stay bound to it: keep a
			// small record of the outcome in place of the answer.
			o.Metrics.OversizeBody.Add(1)
			resp = notStored(resp, o.MaxStoredBody)
		}
		if err := m.complete(st, tx, resp); err != nil {
			o.ErrorHandler(w, r, err)
			return
		}
		rec.writeSplit(w, header, trailer)
	case status >= 400 && status < 500 && l.Attempt <= 1:
		// Refused before anything happened, on the key's first attempt:
		// free the key for a corrected request. On a later attempt an
		// earlier one may have paid, so the key stays bound (below).
		m.release(st)
		rec.writeTo(w)
	default:
		m.abort(st)
		rec.writeTo(w)
	}
}

// fail ends l's attempt; ctx is without cancellation (the request's bctx).
func (m *protocol) fail(ctx context.Context, l *Lease) {
	m.metrics.Failed.Add(1)
	err := m.retryDetached(ctx, "fail", func(ctx context.Context) error { return m.store.Fail(ctx, l) })
	if err != nil && !errors.Is(err, ErrFenced) {
		m.metrics.StoreErrors.Add(1)
		m.logger.WarnContext(ctx, "idem: fail failed", "user", l.User, "operation", OperationID(l.User, l.Key, l.CreatedAt), "err", err)
	}
}

// Store calls that failed for a reason other than an answer of the
// protocol (a dropped connection, a database restarting, a busy file) are
// sent again, with a pause that starts at retryFirstPause and doubles up
// to retryMaxPause, for at most retryBudget in all: a short blip must not
// leave a key claimed, unfailed or unreleased for a whole lease.
const (
	retryFirstPause = 10 * time.Millisecond
	retryMaxPause   = 250 * time.Millisecond
	retryBudget     = 2 * time.Second
)

// retry calls fn until it succeeds, returns an answer of the protocol
// (ErrInFlight, ErrFingerprintMismatch, ErrFenced, ErrNotFound, ErrNotDue), or the
// budget runs out. Every call may be sent again: Claim carries its owner
// token, and Fail and Release are fenced on it, so a call whose answer
// was lost is recognised. The calls follow neither ctx's cancellation
// nor its deadline (the client leaving must not strand a key); each call
// bounds itself (see claimTimeout) and retryBudget bounds them all.
func (m *protocol) retry(ctx context.Context, op string, fn func(context.Context) error) error {
	return m.retryDetached(context.WithoutCancel(ctx), op, fn)
}

// retryDetached is retry with ctx already without cancellation or
// deadline (context.WithoutCancel's, or a context derived from it without
// either): the middleware makes that once per request.
func (m *protocol) retryDetached(ctx context.Context, op string, fn func(context.Context) error) error {
	deadline := time.Now().Add(retryBudget)
	pause := retryFirstPause
	for {
		err := fn(ctx)
		if err == nil || !retryable(err) {
			return err
		}
		if time.Now().Add(pause).After(deadline) {
			return err
		}
		m.metrics.StoreRetries.Add(1)
		m.logger.DebugContext(ctx, "idem: store call failed, sending it again", "op", op, "err", err, "pause", pause)
		time.Sleep(pause)
		pause = min(2*pause, retryMaxPause)
	}
}

// retryable reports whether a store error may be cured by sending the
// call again: any error but the protocol's own answers.
func retryable(err error) bool {
	switch {
	case errors.Is(err, ErrInFlight), errors.Is(err, ErrFingerprintMismatch),
		errors.Is(err, ErrFenced), errors.Is(err, ErrNotFound), errors.Is(err, ErrNotDue):
		return false
	}
	return true
}

// notStored is what is kept in place of resp when its body is over limit:
// the same status and kept headers (Location still names what was made),
// with a problem that says the answer was not kept.
func notStored(resp *Response, limit int64) *Response {
	p := problem.Details{
		Type:   problem.ResponseNotStored,
		Title:  "Answer too large to keep",
		Status: resp.Status,
		Detail: fmt.Sprintf("The request with this Idempotency-Key completed with status %d and its work was committed once; "+
			"its answer (%d bytes of body) was over the %d bytes kept for replay, or its headers held bytes no store keeps, "+
			"so only its status and Location are repeated here. "+
			"It will not run again.", resp.Status, len(resp.Body), limit),
		Extra: map[string]any{"original_status": resp.Status, "original_length": len(resp.Body)},
	}
	b, _ := json.Marshal(p) // problem details of plain values always encode
	// Only Location is kept, when it is of a sane size: the other headers
	// described the original body (or may be what made it too large), and
	// its trailers are left out with it.
	h := http.Header{"Content-Type": {"application/problem+json"}}
	if loc := resp.Header.Values("Location"); len(loc) > 0 && headerSize(http.Header{"Location": loc}) <= maxKeptLocation &&
		keepableHeaders(http.Header{"Location": loc}) {
		h["Location"] = append([]string(nil), loc...)
	}
	return &Response{Status: resp.Status, Header: h, Body: b}
}

// keepableHeaders reports whether every store can keep h exactly: no NUL
// (PostgreSQL's jsonb refuses it) and valid UTF-8 (JSON would replace the
// rest). An answer whose kept headers or trailers are not keepable is
// kept as an answer too large to keep is: the work is never run twice.
func keepableHeaders(h http.Header) bool {
	for k, vs := range h {
		if !keepableText(k) {
			return false
		}
		for _, v := range vs {
			if !keepableText(v) {
				return false
			}
		}
	}
	return true
}

func keepableText(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

// maxKeptLocation bounds the Location kept with an answer too large to keep.
const maxKeptLocation = 8 << 10

// storedSize is what keeping resp costs: its body, headers and trailers.
func storedSize(resp *Response) int64 {
	return int64(len(resp.Body)) + headerSize(resp.Header) + headerSize(resp.Trailer)
}

func headerSize(h http.Header) int64 {
	var n int64
	for k, vs := range h {
		for _, v := range vs {
			n += int64(len(k) + len(v) + 4) // "k: v\r\n"
		}
	}
	return n
}

// runHandler calls h and reports whether it panicked, and whether the
// panic was http.ErrAbortHandler, which must reach net/http.
func runHandler(h http.Handler, w http.ResponseWriter, r *http.Request, logger *slog.Logger) (panicked, abort bool) {
	defer func() {
		if v := recover(); v != nil {
			panicked = true
			abort = v == http.ErrAbortHandler
			if !abort {
				logger.ErrorContext(r.Context(), "idem: handler panicked", "panic", v)
			}
		}
	}()
	h.ServeHTTP(w, r)
	return false, false
}

// readBody reads r's body, up to limit bytes, into room if it fits. The
// body returned has no spare capacity: whatever follows it in room is
// not its.
func readBody(r *http.Request, limit int64, room []byte) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	b, err := readUpTo(r.Body, r.ContentLength, limit+1, room)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, fmt.Errorf("%w: more than %d bytes", ErrRequestTooLarge, mbe.Limit)
		}
		return nil, fmt.Errorf("%w: %w", ErrBadBody, err)
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%w: more than %d bytes", ErrRequestTooLarge, limit)
	}
	return b[:len(b):len(b)], nil
}

// readUpTo is io.ReadAll(io.LimitReader(rd, n)), read into room while it
// fits, then into a buffer of its own. size is the announced length (-1:
// unknown); when it is known the buffer is one byte over it, so that the
// end of the body is seen without growing it.
func readUpTo(rd io.Reader, size, n int64, room []byte) ([]byte, error) {
	want := int64(len(room))
	if size >= 0 && size < n {
		want = size + 1
	}
	var b []byte
	if want <= int64(len(room)) {
		b = room[:0:min(want, n)]
	} else {
		b = make([]byte, 0, min(want, n))
	}
	for int64(len(b)) < n {
		if len(b) == cap(b) {
			b = append(b, 0)[:len(b)] // let append grow it
		}
		m, err := rd.Read(b[len(b):min(int64(cap(b)), n)])
		b = b[:len(b)+m]
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return b, err
		}
	}
	return b, nil
}

// keptHeaders is the part of the request header h that is kept with the
// claim: the names kept, with their values. Requests mostly send the same
// ones (Content-Type: application/json), so the last map made is handed
// out again while h holds the same: stores only read ClaimParams.Header
// (see there). A new map is made with values of its own, and nothing
// changes it after.
func (m *middleware) keptHeaders(h http.Header) http.Header {
	kept, _ := m.headerNames()
	if last, ok := m.lastKept.Load().(http.Header); ok && sameKept(h, kept, last) {
		return last
	}
	n := 0
	for _, k := range kept {
		n += len(h[k])
	}
	vals := make([]string, 0, n)
	out := make(http.Header, len(kept))
	for _, k := range kept {
		if v := h[k]; len(v) > 0 {
			vals = append(vals, v...)
			out[k] = vals[len(vals)-len(v) : len(vals) : len(vals)]
		}
	}
	m.lastKept.Store(out)
	return out
}

// sameKept reports whether the kept names (canonical) of h hold the
// values last holds, and last holds no other name.
func sameKept(h http.Header, kept []string, last http.Header) bool {
	n := 0
	for _, k := range kept {
		v := h[k]
		if len(v) == 0 {
			continue
		}
		n++
		if !slices.Equal(v, last[k]) {
			return false
		}
	}
	return n == len(last)
}
