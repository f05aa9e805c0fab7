package idem

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"time"
)

// CompleterOptions configures a Completer. The zero value is usable.
type CompleterOptions struct {
	// Interval is the pause between two scans. Default 5s.
	Interval time.Duration
	// MaxAttempts bounds the attempts made at one key, the clients'
	// included (a retrying client may spend several); the completer leaves
	// a key alone once it reached it. Default DefaultCompleterMaxAttempts.
	MaxAttempts int
	// Backoff is how long after its second attempt failed a key is
	// re-driven again; it doubles with every further attempt, up to
	// MaxBackoff. The first re-drive is due as soon as the lease ran out.
	// Default 1s.
	Backoff time.Duration
	// MaxBackoff caps Backoff. Default 1m.
	MaxBackoff time.Duration
	// Batch is how many abandoned keys one scan looks at. Default 100.
	Batch int
	// Middleware are the options of the route the requests were made to.
	// Its User function is replaced: a re-driven request belongs to the
	// user who made it.
	Middleware Options
	// Logger receives what the completer did. Default slog.Default().
	Logger *slog.Logger
}

// DefaultCompleterMaxAttempts is the default CompleterOptions.MaxAttempts:
// with the default backoff the completer keeps trying for about a quarter
// of an hour.
const DefaultCompleterMaxAttempts = 20

// CompleterStats is what one scan did.
type CompleterStats struct {
	Scanned   int // abandoned keys seen
	Completed int // re-driven to a stored outcome
	Failed    int // re-driven and failed again (4xx, 5xx, panic): the key stays bound
	Skipped   int // waiting for their backoff, out of attempts, or taken by someone else
}

// Completer finishes requests that were abandoned: their instance crashed,
// their client went away before a retry, or they failed with a 5xx. It runs
// the request that the key's record keeps (method, path, kept headers,
// body, user) through the same middleware and handler, so it claims the
// key like any retry: an attempt still holding its lease is left alone, and
// two completers never run one key at once. A payment made before a
// failure thus always gets its order, whether or not the client retries.
type Completer struct {
	sweeper Sweeper
	handler http.Handler
	opts    CompleterOptions

	mu   sync.Mutex             // guards seen
	seen map[operation]sighting // abandoned operations seen by the last scan
}

// operation names one operation: a key and its record's creation time.
type operation struct {
	user, key string
	created   time.Time
}

// sighting is when the completer first saw an operation abandoned after
// attempts attempts, on the process's monotonic clock: backoff is counted
// from then, never by comparing the store's times with this process's
// wall clock.
type sighting struct {
	attempts int
	at       time.Time
}

type (
	completerUserKey struct{}
	completerOpKey   struct{}
)

// NewCompleter returns a completer that re-drives store's abandoned
// requests through next, behind the idempotency middleware. store must
// implement Sweeper.
func NewCompleter(store Store, next http.Handler, opts CompleterOptions) (*Completer, error) {
	sw, ok := store.(Sweeper)
	if !ok {
		return nil, fmt.Errorf("idem: completer: store %T does not implement Sweeper", store)
	}
	if opts.Interval <= 0 {
		opts.Interval = 5 * time.Second
	}
	if opts.MaxAttempts <= 0 {
		opts.MaxAttempts = DefaultCompleterMaxAttempts
	}
	if opts.Backoff <= 0 {
		opts.Backoff = time.Second
	}
	if opts.MaxBackoff <= 0 {
		opts.MaxBackoff = time.Minute
	}
	if opts.Batch <= 0 {
		opts.Batch = 100
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	mo := opts.Middleware
	mo.User = func(r *http.Request) string {
		u, _ := r.Context().Value(completerUserKey{}).(string)
		return u
	}
	mo.OptionalKey = false
	mo.InFlightWait = 0
	// A re-drive finishes the operation the scan listed, or nothing: if
	// that record was answered and then expired, or deleted, while the
	// scan was busy, the re-drive's claim makes a new record (a new
	// operation, with new downstream keys), which the guard refuses with a
	// 412 before the handler runs; on its first attempt the middleware
	// then frees the key again.
	guard := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		want, _ := r.Context().Value(completerOpKey{}).(time.Time)
		if l, ok := LeaseFromContext(r.Context()); !ok || !l.CreatedAt.Equal(want) {
			w.WriteHeader(http.StatusPreconditionFailed)
			return
		}
		next.ServeHTTP(w, r)
	})
	return &Completer{sweeper: sw, handler: Middleware(store, mo)(guard), opts: opts, seen: make(map[operation]sighting)}, nil
}

// Run scans every Interval until ctx is done.
func (c *Completer) Run(ctx context.Context) {
	t := time.NewTicker(c.opts.Interval)
	defer t.Stop()
	for {
		st, err := c.RunOnce(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			c.opts.Logger.WarnContext(ctx, "idem: completer scan failed", "err", err)
		case st.Completed+st.Failed > 0:
			c.opts.Logger.InfoContext(ctx, "idem: completer re-drove abandoned requests",
				"completed", st.Completed, "failed", st.Failed, "skipped", st.Skipped)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// RunOnce scans once and re-drives every abandoned key that is due.
func (c *Completer) RunOnce(ctx context.Context) (CompleterStats, error) {
	var st CompleterStats
	recs, err := c.sweeper.Abandoned(ctx, c.opts.Batch)
	if err != nil {
		return st, err
	}
	due := c.due(recs)
	for i, rec := range recs {
		if ctx.Err() != nil {
			return st, ctx.Err()
		}
		st.Scanned++
		if rec.Attempts >= c.opts.MaxAttempts || !due[i] {
			st.Skipped++
			continue
		}
		switch status := c.redrive(ctx, rec); {
		case status == http.StatusConflict || status == http.StatusPreconditionFailed:
			st.Skipped++ // another attempt holds it, or the operation is over
		case c.stored(status):
			st.Completed++ // (a handler's 422 may be a stored outcome too)
		case status == http.StatusUnprocessableEntity:
			st.Skipped++ // it changed under us
		default:
			st.Failed++
		}
	}
	return st, nil
}

// due reports, for each of recs, whether its backoff has passed: counted
// from when this completer first saw it abandoned with its present number
// of attempts. The store's lease times are never compared with this
// process's wall clock, which may be off from the database's.
func (c *Completer) due(recs []Record) []bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	out := make([]bool, len(recs))
	seen := make(map[operation]sighting, len(recs))
	for i, rec := range recs {
		op := operation{rec.User, rec.Key, rec.CreatedAt}
		s, ok := c.seen[op]
		if !ok || s.attempts != rec.Attempts {
			s = sighting{attempts: rec.Attempts, at: now}
		}
		seen[op] = s
		out[i] = now.Sub(s.at) >= c.backoff(rec.Attempts)
	}
	c.seen = seen
	return out
}

func (c *Completer) stored(status int) bool {
	if c.opts.Middleware.Stored != nil {
		return c.opts.Middleware.Stored(status)
	}
	return StoredStatus(status)
}

// backoff is how long after it was first seen abandoned a key that has
// seen attempts attempts is due. The first re-drive is due at once, so an
// abandoned request is finished within a lease and an Interval.
func (c *Completer) backoff(attempts int) time.Duration {
	if attempts <= 1 {
		return 0
	}
	d := c.opts.Backoff
	for i := 2; i < attempts && d < c.opts.MaxBackoff; i++ {
		d *= 2
	}
	return min(d, c.opts.MaxBackoff)
}

// redrive runs rec's request and returns the status it was answered with.
func (c *Completer) redrive(ctx context.Context, rec Record) int {
	ctx = context.WithValue(ctx, completerUserKey{}, rec.User)
	ctx = context.WithValue(ctx, completerOpKey{}, rec.CreatedAt)
	req, err := http.NewRequestWithContext(ctx, rec.Method, rec.Path, bytes.NewReader(rec.Body))
	if err != nil {
		c.opts.Logger.WarnContext(ctx, "idem: completer cannot rebuild request", "key", rec.Key, "err", err)
		return http.StatusInternalServerError
	}
	for k, v := range rec.Header {
		req.Header[k] = append([]string(nil), v...)
	}
	req.Header.Set("Idempotency-Key", sfString(rec.Key))
	req.RemoteAddr = "idem-completer"
	rw := httptest.NewRecorder()
	c.handler.ServeHTTP(rw, req)
	c.opts.Logger.InfoContext(ctx, "idem: completer re-drove a request", "user", rec.User, "key", rec.Key, "attempt", rec.Attempts+1, "status", rw.Code)
	return rw.Code
}

// sfString writes key as an RFC 8941 sf-string, which ParseKey reads back
// as key whatever characters it has.
func sfString(key string) string {
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`)
	return `"` + r.Replace(key) + `"`
}
