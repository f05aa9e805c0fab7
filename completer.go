package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/idem-go/idem/idemdriver"
)

// CompleterOptions configures a Completer. The zero value is usable.
type CompleterOptions struct {
	// Interval is the pause between two scans. Default 5s.
	Interval time.Duration
	// MaxAttempts bounds the re-drives of one operation by all the
	// completers sharing the store (the store counts them, as
	// Record.Redrives); the clients' own attempts do not count, so a
	// client that retried all through an outage never spends the
	// completers' budget. Then the key is left for an operator.
	// Default DefaultCompleterMaxAttempts.
	MaxAttempts int
	// Backoff is how long after its first re-drive ended a key is
	// re-driven again; it doubles with every further re-drive, up to
	// MaxBackoff, by the store's clock. The first re-drive is due as soon
	// as the lease ran out. Default 1s.
	Backoff time.Duration
	// MaxBackoff caps Backoff. Default 1m.
	MaxBackoff time.Duration
	// Batch is how many abandoned keys one scan looks at. Default 100.
	Batch int
	// Middleware are the options of the route the requests were made to.
	// Its User function is replaced: a re-driven request belongs to the
	// user who made it. Its Lease, TTL, Metrics and Logger serve the
	// re-drives of Do operations too.
	Middleware Options
	// Funcs are the operations run through Do that the completer
	// finishes, by their DoParams.Operation: an abandoned Do record (one
	// with an empty Method) whose operation is here is run again through
	// Do with the function, its input the record's, as a retry would. A Do
	// record whose operation is not here is skipped without being claimed,
	// and an HTTP record never goes to a function. The map is copied. Nil:
	// Do records are all skipped.
	Funcs map[string]DoFunc
	// Logger receives what the completer did. Default slog.Default().
	Logger *slog.Logger
	// OnScan, if set, is called at the end of every scan (RunOnce's, and
	// so Run's) with what the scan did and its error, from the scanning
	// goroutine: for metrics (idemprom.CompleterMetrics counts scans and
	// re-drives with it). It must return quickly. Nil: nothing is called.
	OnScan func(ctx context.Context, st CompleterStats, err error)
}

// CompleterStats is what one scan did.
type CompleterStats struct {
	Scanned   int // abandoned keys seen
	Completed int // re-driven to a stored outcome
	Failed    int // re-driven and failed again (4xx, 5xx, panic; a Do function's error or panic, a store error): the key stays bound
	GivenUp   int // of those, keys whose last re-drive this was: left for an operator
	Skipped   int // taken by someone else, their operation is over, or nothing here runs it (no handler, an operation not in Funcs)
}

// Completer finishes requests that were abandoned: their instance crashed,
// their client went away before a retry, or they failed with a 5xx. It runs
// the request that the key's record keeps (method, path, kept headers,
// body, user) through the same middleware and handler, so it claims the
// key like any retry: an attempt still holding its lease is left alone, and
// two completers never run one key at once. A payment made before a
// failure thus always gets its order, whether or not the client retries.
//
// Operations run through Do are finished the same way, through Do with
// the function registered under their name (CompleterOptions.Funcs) and
// the input their record keeps.
type Completer struct {
	store   idemdriver.SweepingStore
	handler http.Handler // nil: HTTP records are skipped
	opts    CompleterOptions
	route   *middleware                // the route's middleware, for its store calls
	kinds   *idemdriver.AbandonedKinds // what it re-drives: the scan lists only these
}

// redrive is what a completer's request carries to the middleware: the
// operation it re-drives, the lease the completer already took on it,
// and the record's fingerprint, which the middleware does not compute
// again (a rebuilt request could hash otherwise, and the key would be
// listed for ever).
type redrive struct {
	params      *idemdriver.RedriveParams
	owner       string
	fingerprint string
}

type (
	completerUserKey struct{}
	completerOpKey   struct{}
)

// NewCompleter returns a completer that re-drives store's abandoned
// requests through next, behind the idempotency middleware, and its
// abandoned Do operations through the functions of opts.Funcs. next may
// be nil when opts.Funcs is not empty: HTTP records are then skipped.
//
// As every constructor of this package, it checks its arguments at once
// and panics with a message naming what is wrong: a nil store, both next
// and opts.Funcs nil or empty, an entry of opts.Funcs with an invalid
// operation name or a nil function, a negative Interval, MaxAttempts,
// Backoff, MaxBackoff or Batch, a MaxBackoff shorter than Backoff, or
// opts.Middleware options that Middleware would refuse (its User is the
// completer's own and is not checked).
func NewCompleter(store idemdriver.SweepingStore, next http.Handler, opts CompleterOptions) *Completer {
	if store == nil {
		panic("idem.NewCompleter: nil store")
	}
	if next == nil && len(opts.Funcs) == 0 {
		panic("idem.NewCompleter: nothing to re-drive: next is nil and CompleterOptions.Funcs is empty")
	}
	if err := opts.check(); err != nil {
		panic("idem.NewCompleter: " + err.Error())
	}
	opts.Funcs = maps.Clone(opts.Funcs)
	opts = opts.withDefaults()
	mo := opts.Middleware
	mo.User = func(r *http.Request) string {
		u, _ := r.Context().Value(completerUserKey{}).(string)
		return u
	}
	mo.OptionalKey = false
	mo.InFlightWait = 0
	// The scan lists only what this completer runs: records it would skip
	// without a claim must not fill its batches.
	kinds := &idemdriver.AbandonedKinds{HTTP: next != nil, Operations: slices.Sorted(maps.Keys(opts.Funcs))}
	c := &Completer{store: store, opts: opts, route: newMiddleware(store, mo.withDefaults()), kinds: kinds}
	if next != nil {
		// A re-drive finishes the operation the scan listed, or nothing:
		// its claim (ClaimParams.Redrive) takes over only that operation
		// and only while it is due, and otherwise answers ErrNotDue (412).
		// The guard checks it once more before the handler runs.
		guard := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			want := redriveOf(r.Context())
			if l, ok := LeaseFromContext(r.Context()); !ok || want == nil || !l.CreatedAt.Equal(want.params.CreatedAt) {
				w.WriteHeader(http.StatusPreconditionFailed)
				return
			}
			next.ServeHTTP(w, r)
		})
		c.handler = Middleware(store, mo)(guard)
	}
	return c
}

// check reports the first of o's fields that NewCompleter refuses.
func (o CompleterOptions) check() error {
	for name, fn := range o.Funcs {
		if !validOperation(name) {
			return fmt.Errorf("invalid CompleterOptions.Funcs[%q]: not an operation name", name)
		}
		if fn == nil {
			return fmt.Errorf("invalid CompleterOptions.Funcs[%q]: nil function", name)
		}
	}
	for _, d := range [...]struct {
		name string
		v    time.Duration
	}{{"Interval", o.Interval}, {"Backoff", o.Backoff}, {"MaxBackoff", o.MaxBackoff}} {
		if d.v < 0 {
			return fmt.Errorf("invalid CompleterOptions.%s %v: negative (zero means the default)", d.name, d.v)
		}
	}
	if o.MaxAttempts < 0 {
		return fmt.Errorf("invalid CompleterOptions.MaxAttempts %d: negative (zero means the default)", o.MaxAttempts)
	}
	if o.Batch < 0 {
		return fmt.Errorf("invalid CompleterOptions.Batch %d: negative (zero means the default)", o.Batch)
	}
	if d := o.withDefaults(); d.MaxBackoff < d.Backoff {
		return fmt.Errorf("invalid CompleterOptions.MaxBackoff %v: shorter than Backoff %v", d.MaxBackoff, d.Backoff)
	}
	mo := o.Middleware
	if err := mo.check(); err != nil {
		return fmt.Errorf("CompleterOptions.Middleware: %w", err)
	}
	return nil
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
// most Batch of them. The store says which are due (AbandonedParams): its
// clock, its count of re-drives, shared by every completer and kept
// across restarts, so two completers never reset each other's budget or
// backoff, and keys given up on are not even listed.
func (c *Completer) RunOnce(ctx context.Context) (CompleterStats, error) {
	st, err := c.runOnce(ctx)
	if c.opts.OnScan != nil {
		c.opts.OnScan(ctx, st, err)
	}
	return st, err
}

func (c *Completer) runOnce(ctx context.Context) (CompleterStats, error) {
	var st CompleterStats
	recs, err := c.store.Abandoned(ctx, c.params())
	if err != nil {
		return st, err
	}
	for _, rec := range recs {
		if ctx.Err() != nil {
			return st, ctx.Err()
		}
		st.Scanned++
		owner := idemdriver.NewOwner()
		switch c.redriveAny(ctx, rec, owner) {
		case redriveSkipped:
			st.Skipped++
		case redriveCompleted:
			st.Completed++
		default:
			st.Failed++
			if cur, ok := c.gaveUp(ctx, rec, owner); ok {
				st.GivenUp++
				c.route.opts.Metrics.GivenUp.Add(1)
				// Logged with an id of the operation, never the key itself,
				// which a client may have made of private data.
				c.opts.Logger.WarnContext(ctx, "idem: completer gave a request up; it is left for an operator",
					"user", rec.User, "operation", idemdriver.OperationID(rec.User, rec.Key, rec.CreatedAt),
					"attempts", cur.Attempts, "redrives", cur.Redrives)
			}
		}
	}
	return st, nil
}

// redriveOutcome is how a re-drive ended, for CompleterStats.
type redriveOutcome int

const (
	redriveFailed    redriveOutcome = iota // run again and failed: the key stays bound
	redriveCompleted                       // run to a stored outcome
	redriveSkipped                         // not run: held, over, changed, or nothing here runs it
)

// redriveAny re-drives rec, its lease taken with owner: a Do operation
// through its function (redriveDo), an HTTP request through the handler
// (redrive). A record that nothing here runs is skipped, never claimed.
func (c *Completer) redriveAny(ctx context.Context, rec idemdriver.Record, owner string) redriveOutcome {
	if rec.Method == "" {
		return c.redriveDo(ctx, rec, owner)
	}
	if c.handler == nil {
		return redriveSkipped
	}
	switch status := c.redrive(ctx, rec, owner); {
	case status == http.StatusConflict || status == http.StatusPreconditionFailed:
		return redriveSkipped // another attempt holds it, or the operation is over
	case c.stored(status):
		return redriveCompleted // (a handler's 422 may be a stored outcome too)
	case status == http.StatusUnprocessableEntity:
		return redriveSkipped // it changed under us
	default:
		return redriveFailed
	}
}

// redriveDo runs the Do operation rec again through Do, its lease taken
// with owner by a re-drive claim (ClaimParams.Redrive), as an HTTP
// request's re-drive claims it. An operation not in Funcs is skipped
// without a claim, and so is a record whose fingerprint is not its
// operation's and input's Do fingerprint: an HTTP request never reaches
// a function, even one whose method was empty.
func (c *Completer) redriveDo(ctx context.Context, rec idemdriver.Record, owner string) redriveOutcome {
	fn := c.opts.Funcs[rec.Path]
	if fn == nil || rec.Fingerprint != doFingerprint(rec.Path, rec.Body) {
		return redriveSkipped
	}
	cp := idemdriver.ClaimParams{
		User: rec.User, Key: rec.Key, Fingerprint: rec.Fingerprint, Owner: owner,
		Redrive: &idemdriver.RedriveParams{CreatedAt: rec.CreatedAt, Due: c.params()},
		Path:    rec.Path, Body: rec.Body, Lease: c.route.opts.Lease, TTL: c.route.opts.TTL,
	}
	_, fnFailed, err := c.route.do(ctx, &cp, fn)
	op := idemdriver.OperationID(rec.User, rec.Key, rec.CreatedAt)
	switch {
	case err == nil:
		c.opts.Logger.InfoContext(ctx, "idem: completer re-drove an operation", "user", rec.User, "operation", op, "op", rec.Path, "attempt", rec.Attempts+1)
		return redriveCompleted
	case !fnFailed && (errors.Is(err, ErrNotDue) || errors.Is(err, ErrInFlight) || errors.Is(err, ErrFenced) || errors.Is(err, ErrFingerprintMismatch)):
		return redriveSkipped // as an HTTP re-drive's 412, 409 and 422
	default:
		c.opts.Logger.WarnContext(ctx, "idem: completer's re-drive of an operation failed", "user", rec.User, "operation", op, "op", rec.Path, "attempt", rec.Attempts+1, "err", err)
		return redriveFailed
	}
}

// gaveUp reports whether the failed re-drive of rec with owner was the
// completers' last: the store's record, read after it, still has that
// owner's takeover (the last claim), no response, and the count of
// re-drives the takeover set at the budget. The listed count is not
// enough: between the listing and the takeover another completer and an
// operator's Redrive may have changed it. When the record cannot be
// read, the listed count decides.
func (c *Completer) gaveUp(ctx context.Context, rec idemdriver.Record, owner string) (idemdriver.Record, bool) {
	cur, err := c.store.Get(ctx, rec.User, rec.Key)
	if err != nil {
		if errors.Is(err, ErrNotFound) {
			return rec, false
		}
		rec.Attempts, rec.Redrives = rec.Attempts+1, rec.Redrives+1
		return rec, rec.Redrives >= c.opts.MaxAttempts
	}
	return *cur, cur.Owner == owner && cur.Response == nil && cur.Redrives >= c.opts.MaxAttempts
}

// redriveOf returns what a completer's request re-drives, nil for any
// other request.
func redriveOf(ctx context.Context) *redrive {
	rd, _ := ctx.Value(completerOpKey{}).(*redrive)
	return rd
}

func (c *Completer) params() idemdriver.AbandonedParams {
	return idemdriver.AbandonedParams{Limit: c.opts.Batch, MaxRedrives: c.opts.MaxAttempts, Backoff: c.opts.Backoff, MaxBackoff: c.opts.MaxBackoff, Kinds: c.kinds}
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

// redrive runs rec's request, its lease taken with owner, and returns the
// status it was answered with.
//
// It takes the lease first, through the store: the re-drive is counted
// then, whatever happens next (a request that cannot be rebuilt, a
// middleware that refuses it before its claim), so no key stays listed
// for ever uncounted. The middleware's own claim is the same claim sent
// again (same owner), which returns that lease. Whatever the outcome, the
// lease ends when the request does (Fail finds nothing to do once the
// outcome committed).
func (c *Completer) redrive(ctx context.Context, rec idemdriver.Record, owner string) int {
	rd := &redrive{params: &idemdriver.RedriveParams{CreatedAt: rec.CreatedAt, Due: c.params()}, owner: owner, fingerprint: rec.Fingerprint}
	// As the middleware claims: bounded, resent after an error with the
	// same owner, apart from the scan's cancellation.
	cl, err := c.route.claim(ctx, idemdriver.ClaimParams{
		User: rec.User, Key: rec.Key, Fingerprint: rec.Fingerprint, Owner: rd.owner, Redrive: rd.params,
		Method: rec.Method, Path: rec.Path, Header: rec.Header, Body: rec.Body, Lease: c.route.opts.Lease, TTL: c.route.opts.TTL,
	})
	switch {
	case errors.Is(err, ErrNotDue):
		return http.StatusPreconditionFailed
	case errors.Is(err, ErrInFlight):
		return http.StatusConflict
	case errors.Is(err, ErrFingerprintMismatch):
		return http.StatusUnprocessableEntity
	case err != nil:
		c.opts.Logger.WarnContext(ctx, "idem: completer claim failed", "operation", idemdriver.OperationID(rec.User, rec.Key, rec.CreatedAt), "err", err)
		return http.StatusServiceUnavailable
	case cl.Response != nil:
		return cl.Response.Status
	}
	defer func() {
		err := c.route.retry(ctx, "fail", func(ctx context.Context) error { return c.store.Fail(ctx, cl.Lease) })
		if err != nil && !errors.Is(err, ErrFenced) {
			c.opts.Logger.WarnContext(ctx, "idem: completer could not end its lease", "operation", idemdriver.OperationID(rec.User, rec.Key, rec.CreatedAt), "err", err)
		}
	}()
	ctx = context.WithValue(ctx, completerUserKey{}, rec.User)
	ctx = context.WithValue(ctx, completerOpKey{}, rd)
	u, err := url.ParseRequestURI(rec.Path) // as net/http read it
	if err != nil {
		c.opts.Logger.WarnContext(ctx, "idem: completer cannot rebuild request", "operation", idemdriver.OperationID(rec.User, rec.Key, rec.CreatedAt), "path", rec.Path, "err", err)
		return http.StatusInternalServerError
	}
	req, err := http.NewRequestWithContext(ctx, rec.Method, "http://idem-completer/", bytes.NewReader(rec.Body))
	if err != nil {
		c.opts.Logger.WarnContext(ctx, "idem: completer cannot rebuild request", "operation", idemdriver.OperationID(rec.User, rec.Key, rec.CreatedAt), "method", rec.Method, "err", err)
		return http.StatusInternalServerError
	}
	req.URL.Path, req.URL.RawPath, req.URL.RawQuery = u.Path, u.RawPath, u.RawQuery
	req.RequestURI = rec.Path
	for k, v := range rec.Header {
		req.Header[k] = append([]string(nil), v...)
	}
	req.Header.Set("Idempotency-Key", sfString(rec.Key))
	req.RemoteAddr = "idem-completer"
	// Only the status is read; the middleware writes the answer here
	// once its outcome is settled.
	rw := &recorder{header: make(http.Header)}
	if !serveRecovered(c.handler, rw, req) {
		// http.ErrAbortHandler, re-panicked by the middleware for net/http,
		// which is not there: the attempt failed (the middleware ended it).
		c.opts.Logger.WarnContext(ctx, "idem: completer's re-drive aborted", "user", rec.User, "operation", idemdriver.OperationID(rec.User, rec.Key, rec.CreatedAt))
		return http.StatusInternalServerError
	}
	c.opts.Logger.InfoContext(ctx, "idem: completer re-drove a request", "user", rec.User, "operation", idemdriver.OperationID(rec.User, rec.Key, rec.CreatedAt), "attempt", rec.Attempts+1, "status", rw.statusCode())
	return rw.statusCode()
}

// serveRecovered serves req with h and reports false if h panicked.
func serveRecovered(h http.Handler, w http.ResponseWriter, req *http.Request) (ok bool) {
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	h.ServeHTTP(w, req)
	return true
}

// sfString writes key as an RFC 8941 sf-string, which ParseKey reads back
// as key whatever characters it has.
func sfString(key string) string {
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`)
	return `"` + r.Replace(key) + `"`
}
