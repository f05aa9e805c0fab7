package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/problem"
)

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

// Middleware returns middleware that makes the wrapped handler idempotent
// with store. Requests with safe methods (GET, HEAD, OPTIONS, TRACE) pass
// through untouched.
//
// Middleware checks its arguments when it is called, not on the first
// request, and panics with a message naming what is wrong: a nil store,
// a nil Options.User (there is no default scope: give the function that
// names the caller, or SharedKeySpace on purpose), a negative Options.TTL, Lease, InFlightWait, MaxRequestBody or
// MaxStoredBody, a Lease (or its default) not shorter than the TTL (or its default), or an entry of Options.StoredHeaders or
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
	resp idemdriver.Response // the response given to the store's Complete
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

func (b *bodyReader) Read(p []byte) (int, error) { return b.r.Read(p) }

func (b *bodyReader) WriteTo(w io.Writer) (int64, error) { return b.r.WriteTo(w) }

func (*bodyReader) Close() error { return nil }

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
	p := idemdriver.ClaimParams{
		User:   o.User(r),
		Key:    key,
		Owner:  idemdriver.NewOwner(),
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

// execute runs next under lease l and settles the outcome.
// body is the request body read; bctx is the request's context without
// its cancellation; x holds the request's state, context and recorder.
func (m *middleware) execute(w http.ResponseWriter, r *http.Request, next http.Handler, l *idemdriver.Lease, body []byte, bctx context.Context, x *exchange) {
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
		x.resp = idemdriver.Response{Status: status, Header: storedHeaders(header, stored), Body: rec.body,
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
