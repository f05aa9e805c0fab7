package idem

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
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
	if lease, ttl := cmp.Or(o.Lease, DefaultLease), cmp.Or(o.TTL, DefaultTTL); lease >= ttl {
		return fmt.Errorf("invalid Options.Lease %v: not shorter than Options.TTL %v (a key that expires while an attempt holds it could be claimed again, and its request run twice)", lease, ttl)
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

// Defaults for ClaimParams and Options.
const (
	DefaultMaxStoredBody  = 1 << 20
	DefaultMaxRequestBody = 1 << 20
)
