package idem

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"time"
)

// CompleterOptions configures a Completer. The zero value is usable.
type CompleterOptions struct {
	// Interval is the pause between two scans. Default 5s.
	Interval time.Duration
	// MaxAttempts bounds the re-drives this completer makes of one
	// operation, counted in memory since it started; the clients' own
	// attempts do not count, so a client that retried all through an
	// outage never spends the completer's budget. Once a completer made
	// them all it leaves the key alone (a restarted one tries again).
	// Default DefaultCompleterMaxAttempts.
	MaxAttempts int
	// Backoff is how long after its first re-drive failed a key is
	// re-driven again; it doubles with every further re-drive, up to
	// MaxBackoff. The first re-drive is due as soon as the key is seen
	// abandoned. Default 1s.
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

	mu   sync.Mutex              // guards seen
	seen map[operation]*sighting // abandoned operations this completer saw
}

// operation names one operation: a key and its record's creation time.
type operation struct {
	user, key string
	created   time.Time
}

// sighting is when the completer first saw an operation abandoned after
// attempts attempts, on the process's monotonic clock (backoff is counted
// from then, never by comparing the store's times with this process's
// wall clock), and how often this completer re-drove it.
type sighting struct {
	attempts int
	at       time.Time
	redrives int
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
	opts = opts.withDefaults()
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
	return &Completer{sweeper: sw, handler: Middleware(store, mo)(guard), opts: opts, seen: make(map[operation]*sighting)}, nil
}

func (o CompleterOptions) withDefaults() CompleterOptions {
	if o.Interval <= 0 {
		o.Interval = 5 * time.Second
	}
	if o.MaxAttempts <= 0 {
		o.MaxAttempts = DefaultCompleterMaxAttempts
	}
	if o.Backoff <= 0 {
		o.Backoff = time.Second
	}
	if o.MaxBackoff <= 0 {
		o.MaxBackoff = time.Minute
	}
	if o.Batch <= 0 {
		o.Batch = 100
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return o
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

// RunOnce scans once and re-drives the abandoned keys that are due, at
// most Batch of them.
//
// The store lists abandoned keys fewest attempts first, and a key that
// waits for its backoff, or that this completer gave up on, would fill the
// list ahead of keys that are due (one whose client retried many times
// sorts late). So the scan asks for Batch more keys than this completer
// knows to be waiting (up to maxListFactor times Batch in all), and skips
// the waiting ones.
func (c *Completer) RunOnce(ctx context.Context) (CompleterStats, error) {
	var st CompleterStats
	limit := c.opts.Batch + min(c.waiting(), (maxListFactor-1)*c.opts.Batch)
	recs, err := c.sweeper.Abandoned(ctx, limit)
	if err != nil {
		return st, err
	}
	due := c.plan(recs, len(recs) < limit)
	for i, rec := range recs {
		if ctx.Err() != nil {
			return st, ctx.Err()
		}
		st.Scanned++
		if !due[i] {
			st.Skipped++
			continue
		}
		switch status := c.redrive(ctx, rec); {
		case status == http.StatusConflict || status == http.StatusPreconditionFailed:
			st.Skipped++ // another attempt holds it, or the operation is over
		case c.stored(status):
			st.Completed++ // (a handler's 422 may be a stored outcome too)
			c.forget(rec)
		case status == http.StatusUnprocessableEntity:
			st.Skipped++ // it changed under us
		default:
			st.Failed++
		}
	}
	return st, nil
}

// maxListFactor bounds a scan's list at this many times Batch, and
// maxSeen the operations a completer remembers.
const (
	maxListFactor = 10
	maxSeen       = 100_000
)

// waiting counts the operations this completer remembers that are not due
// now: in their backoff, or out of budget.
func (c *Completer) waiting() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	n := 0
	for _, s := range c.seen {
		if !c.isDue(s, now) {
			n++
		}
	}
	return n
}

func (c *Completer) isDue(s *sighting, now time.Time) bool {
	return s.redrives < c.opts.MaxAttempts && now.Sub(s.at) >= c.backoff(s.redrives+1)
}

// plan reports, for each of recs, whether it is to be re-driven now (at
// most Batch of them), and counts those re-drives: this completer has
// budget left for it, and its backoff has passed, counted from when this
// completer first saw it abandoned with its present number of attempts.
// The store's lease times are never compared with this process's wall
// clock, which may be off from the database's. With complete set (recs
// is every abandoned key), the operations it remembers that recs lacks are
// over and forgotten.
func (c *Completer) plan(recs []Record, complete bool) []bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	out := make([]bool, len(recs))
	listed := make(map[operation]bool, len(recs))
	planned := 0
	for i, rec := range recs {
		op := operation{rec.User, rec.Key, rec.CreatedAt}
		listed[op] = true
		s, ok := c.seen[op]
		if !ok {
			s = &sighting{attempts: rec.Attempts, at: now}
			c.seen[op] = s
		} else if s.attempts != rec.Attempts {
			s.attempts, s.at = rec.Attempts, now
		}
		if planned < c.opts.Batch && c.isDue(s, now) {
			out[i] = true
			s.redrives++
			planned++
		}
	}
	if complete {
		for op := range c.seen {
			if !listed[op] {
				delete(c.seen, op)
			}
		}
	}
	if len(c.seen) > maxSeen {
		c.evictOldest(listed)
	}
	return out
}

// evictOldest forgets the operations, not in keep, seen longest ago, down
// to maxSeen. A forgotten one that is still abandoned is seen anew: at
// worst re-driven earlier, and given a budget again.
func (c *Completer) evictOldest(keep map[operation]bool) {
	type entry struct {
		op operation
		at time.Time
	}
	var old []entry
	for op, s := range c.seen {
		if !keep[op] {
			old = append(old, entry{op, s.at})
		}
	}
	slices.SortFunc(old, func(a, b entry) int { return a.at.Compare(b.at) })
	for _, e := range old[:min(len(old), len(c.seen)-maxSeen)] {
		delete(c.seen, e.op)
	}
}

// forget drops what the completer remembers of rec's operation, which it
// just finished.
func (c *Completer) forget(rec Record) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.seen, operation{rec.User, rec.Key, rec.CreatedAt})
}

// GiveUpAfter is how long after its last attempt's lease ended a key
// without an outcome is surely no longer re-driven by a running completer
// with these options: the longest pause between two re-drives
// (MaxBackoff), two scan intervals and a minute's slack. An audit may call
// a payment whose key has waited longer than that abandoned.
func (o CompleterOptions) GiveUpAfter() time.Duration {
	o = o.withDefaults()
	return o.MaxBackoff + 2*o.Interval + time.Minute
}

func (c *Completer) stored(status int) bool {
	if c.opts.Middleware.Stored != nil {
		return c.opts.Middleware.Stored(status)
	}
	return StoredStatus(status)
}

// backoff is how long after it was last seen to change a key is due for
// its redrive-th re-drive. The first re-drive is due at once, so an
// abandoned request is finished within a lease and an Interval.
func (c *Completer) backoff(redrive int) time.Duration {
	if redrive <= 1 {
		return 0
	}
	d := c.opts.Backoff
	for i := 2; i < redrive && d < c.opts.MaxBackoff; i++ {
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
