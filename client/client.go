// Package client is for callers of idempotent APIs: a RoundTripper that
// gives every unsafe request an Idempotency-Key and retries it, with that
// same key and the same body, until it gets an answer that is final, and a
// helper that derives keys for the calls one operation makes downstream.
//
// Retrying is only safe because the server deduplicates by key: a request
// that timed out may have been executed, and its retry must name the same
// operation, never a new one.
//
// ExampleTransport shows a POST whose answer is lost on the way back: the
// retry carries the same key and gets the order made, replayed.
// ExampleTransport_inFlight shows a retry after a 409 with Retry-After.
package client

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"time"
)

// Defaults of Transport.
const (
	DefaultMaxAttempts    = 8
	DefaultInitialBackoff = 100 * time.Millisecond
	DefaultMaxBackoff     = 5 * time.Second
	DefaultMaxElapsed     = 30 * time.Second
	DefaultMaxRetryAfter  = 30 * time.Second
)

// Transport is an http.RoundTripper that adds an Idempotency-Key to POST,
// PUT, PATCH and DELETE requests (the key in the request's context, see
// WithKey, or a fresh UUIDv4; a key already in the header is kept), and
// retries time-outs, dropped connections, 5xx, 409 and 429 with capped
// exponential backoff and full jitter, honouring Retry-After, until an
// answer is final, MaxAttempts is reached or the deadline passes. Other
// methods pass through once. The zero value is usable.
//
// Retry-After is delay-seconds (digits only) or an HTTP-date (a date in the
// past means at once), RFC 9110 §10.2.3; its pause is capped at
// MaxRetryAfter, and a pause that would end past the deadline ends the
// exchange with the last answer instead. A malformed value is ignored: the
// usual backoff applies. Retry-After may lengthen any pause, but shorten
// only the first retry's (down to zero, at once): from the second retry on
// the pause is max(Retry-After, backoff), the usual capped, jittered
// backoff being a floor, so that a server answering "Retry-After: 0" (or a
// past date, its clock behind ours) on every attempt does not draw a storm
// of back-to-back retries.
type Transport struct {
	// Base makes the attempts. Default http.DefaultTransport.
	Base http.RoundTripper
	// MaxAttempts bounds the attempts, the first included. Default 8.
	MaxAttempts int
	// InitialBackoff is the pause before the first retry; it doubles with
	// every retry up to MaxBackoff, and each pause is drawn uniformly from
	// [backoff/2, backoff]. Defaults 100ms and 5s.
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	// MaxElapsed is the deadline of the whole exchange when the request's
	// context has none. Default 30s.
	MaxElapsed time.Duration
	// MaxRetryAfter caps the pause a Retry-After asks for, however large
	// (a larger one waits MaxRetryAfter). Default 30s.
	MaxRetryAfter time.Duration
	// AttemptTimeout bounds one attempt, so that a hung attempt is retried.
	// Default 0: only the deadline bounds it.
	AttemptTimeout time.Duration
	// OnRetry, if set, is told of every retry before its pause.
	OnRetry func(attempt int, resp *http.Response, err error, pause time.Duration)
}

type keyCtx struct{}

// WithKey returns a context whose unsafe requests carry key.
func WithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyCtx{}, key)
}

// KeyFromContext returns the key set by WithKey.
func KeyFromContext(ctx context.Context) (string, bool) {
	k, ok := ctx.Value(keyCtx{}).(string)
	return k, ok && k != ""
}

// NewKey returns a random UUIDv4.
func NewKey() string {
	var b [16]byte
	crand.Read(b[:]) // never fails (Go 1.24+)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

func unsafeMethod(m string) bool {
	switch m {
	case http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete:
		return true
	}
	return false
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	if !unsafeMethod(req.Method) {
		return base.RoundTrip(req)
	}
	body, err := replayable(req)
	if err != nil {
		return nil, err
	}
	key := req.Header.Get("Idempotency-Key")
	if key == "" {
		if k, ok := KeyFromContext(req.Context()); ok {
			key = k
		} else {
			key = NewKey()
		}
	}
	// The exchange's deadline lives until the caller closes the body of
	// the answer it gets: cancelling on return would cut the body short.
	ctx, cancel := req.Context(), context.CancelFunc(func() {})
	if _, ok := ctx.Deadline(); !ok {
		ctx, cancel = context.WithTimeout(ctx, t.maxElapsed())
	}
	done := func(resp *http.Response, err error) (*http.Response, error) {
		if resp == nil {
			cancel()
			return nil, err
		}
		resp.Body = &cancelOnClose{ReadCloser: resp.Body, cancel: cancel}
		return resp, err
	}
	maxAttempts := t.MaxAttempts
	if maxAttempts <= 0 {
		maxAttempts = DefaultMaxAttempts
	}
	backoff := t.InitialBackoff
	if backoff <= 0 {
		backoff = DefaultInitialBackoff
	}
	maxBackoff := t.MaxBackoff
	if maxBackoff <= 0 {
		maxBackoff = DefaultMaxBackoff
	}
	maxRetryAfter := t.MaxRetryAfter
	if maxRetryAfter <= 0 {
		maxRetryAfter = DefaultMaxRetryAfter
	}

	for attempt := 1; ; attempt++ {
		resp, err := t.attempt(ctx, base, req, key, body)
		if !retryable(resp, err) || attempt >= maxAttempts {
			return done(resp, err)
		}
		pause := backoff/2 + rand.N(backoff/2+1)
		if resp != nil {
			if ra, ok := parseRetryAfter(resp.Header.Get("Retry-After"), time.Now()); ok {
				ra = min(ra, maxRetryAfter)
				if attempt == 1 {
					pause = ra // may retry at once
				} else {
					pause = max(ra, pause) // backoff is the floor: no storm
				}
			}
		}
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < pause {
			return done(resp, err) // the deadline would pass while we wait
		}
		if t.OnRetry != nil {
			t.OnRetry(attempt, resp, err, pause)
		}
		if resp != nil {
			io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
			resp.Body.Close()
		}
		timer := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			timer.Stop()
			return done(nil, fmt.Errorf("client: retrying %s %s: %w", req.Method, req.URL.Redacted(), ctx.Err()))
		case <-timer.C:
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

func (t *Transport) maxElapsed() time.Duration {
	if t.MaxElapsed > 0 {
		return t.MaxElapsed
	}
	return DefaultMaxElapsed
}

// attempt sends one copy of req. With AttemptTimeout set, the attempt's
// context lives until its response body is closed.
func (t *Transport) attempt(ctx context.Context, base http.RoundTripper, req *http.Request, key string, body []byte) (*http.Response, error) {
	cancel := context.CancelFunc(func() {})
	if t.AttemptTimeout > 0 {
		ctx, cancel = context.WithTimeout(ctx, t.AttemptTimeout)
	}
	r := req.Clone(ctx)
	r.Header.Set("Idempotency-Key", key)
	if body != nil {
		r.Body = io.NopCloser(bytes.NewReader(body))
		r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
		r.ContentLength = int64(len(body))
	}
	resp, err := base.RoundTrip(r)
	if err != nil {
		cancel()
		return nil, err
	}
	resp.Body = &cancelOnClose{ReadCloser: resp.Body, cancel: cancel}
	return resp, nil
}

type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (c *cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.cancel()
	return err
}

// replayable reads req's body once so every attempt sends the same bytes.
func replayable(req *http.Request) ([]byte, error) {
	if req.Body == nil || req.Body == http.NoBody {
		return nil, nil
	}
	defer req.Body.Close()
	b, err := io.ReadAll(req.Body)
	if err != nil {
		return nil, fmt.Errorf("client: reading request body: %w", err)
	}
	return b, nil
}

// retryable reports whether an attempt's outcome may change on a retry with
// the same key: it failed in transit, the server failed, or the operation
// is still running (409) or locked (429).
func retryable(resp *http.Response, err error) bool {
	if err != nil {
		// A cancelled or expired caller context is final; anything else
		// in transit (time-out of the attempt, reset, EOF) is retried.
		return !errors.Is(err, context.Canceled)
	}
	switch {
	case resp.StatusCode >= 500:
		return resp.StatusCode != http.StatusNotImplemented
	case resp.StatusCode == http.StatusConflict, resp.StatusCode == http.StatusTooManyRequests:
		return true
	}
	return false
}

// parseRetryAfter reads a Retry-After value (RFC 9110 §10.2.3): either
// delay-seconds, one or more digits, saturating at the largest Duration
// rather than wrapping; or an HTTP-date, as a pause from now, 0 if it has
// passed. Anything else (a sign, a fraction, a bad date) is not a value.
// The pause is never negative.
func parseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	if v == "" {
		return 0, false
	}
	if digits(v) {
		const maxSeconds = int64(math.MaxInt64 / int64(time.Second))
		var s int64
		for i := 0; i < len(v); i++ {
			s = s*10 + int64(v[i]-'0')
			if s > maxSeconds {
				return time.Duration(math.MaxInt64), true
			}
		}
		return time.Duration(s) * time.Second, true
	}
	if d, err := http.ParseTime(v); err == nil {
		return max(d.Sub(now), 0), true // Sub saturates; never wraps
	}
	return 0, false
}

func digits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}
