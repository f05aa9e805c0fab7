package idem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/idem-go/idem/idemdriver"
)

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
func (m *protocol) claim(rctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	return m.claimFrom(rctx, context.WithoutCancel(rctx), p, nil)
}

// claimFrom is claim with dctx, rctx without its cancellation, made by
// the caller; first, if not nil, is the context of the first store call
// (later calls get new ones).
func (m *protocol) claimFrom(rctx, dctx context.Context, p idemdriver.ClaimParams, first *callCtx) (idemdriver.Claim, error) {
	var deadline time.Time
	if m.inFlightWait > 0 {
		deadline = m.now().Add(m.inFlightWait)
	}
	pause := 5 * time.Millisecond
	for {
		var c idemdriver.Claim
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
func (m *protocol) claimFailed(ctx context.Context, p *idemdriver.ClaimParams, err error) error {
	switch {
	case errors.Is(err, ErrInFlight):
		m.metrics.Conflicts.Add(1)
	case errors.Is(err, ErrFingerprintMismatch):
		m.metrics.Mismatches.Add(1)
	case errors.Is(err, ErrNotDue): // a completer's stale re-drive
	default:
		m.metrics.StoreErrors.Add(1)
		logRepeated(ctx, m.logger, slog.LevelError, "idem: claim failed", err, "user", p.User, "key_id", idemdriver.KeyID(p.User, p.Key))
		return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
	}
	return err
}

// start counts an attempt run under lease l and sets st, its state, for
// it: bctx, the caller's context without its cancellation, is where the
// attempt's store calls run. The caller puts st in the work's context
// (stateCtx) and defers st.rollback.
func (m *protocol) start(st *requestState, l *idemdriver.Lease, bctx context.Context) {
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
func (m *protocol) complete(st *requestState, tx Tx, resp *idemdriver.Response) error {
	switch err := tx.Complete(st.beginCtx, resp); {
	case errors.Is(err, ErrFenced):
		m.metrics.Fenced.Add(1)
		return err
	case err != nil:
		l := st.lease
		m.metrics.StoreErrors.Add(1)
		logRepeated(st.beginCtx, m.logger, slog.LevelError, "idem: complete failed", err,
			"user", l.User, "operation", idemdriver.OperationID(l.User, l.Key, l.CreatedAt), "attempt", l.Attempt)
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
		m.logger.WarnContext(st.beginCtx, "idem: release failed", "user", l.User, "operation", idemdriver.OperationID(l.User, l.Key, l.CreatedAt), "err", err)
	}
}

// fail ends l's attempt; ctx is without cancellation (the request's bctx).
func (m *protocol) fail(ctx context.Context, l *idemdriver.Lease) {
	m.metrics.Failed.Add(1)
	err := m.retryDetached(ctx, "fail", func(ctx context.Context) error { return m.store.Fail(ctx, l) })
	if err != nil && !errors.Is(err, ErrFenced) {
		m.metrics.StoreErrors.Add(1)
		m.logger.WarnContext(ctx, "idem: fail failed", "user", l.User, "operation", idemdriver.OperationID(l.User, l.Key, l.CreatedAt), "err", err)
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
