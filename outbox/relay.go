package outbox

import (
	"context"
	"log/slog"
	"time"
)

// Defaults of RelayOptions.
const (
	DefaultInterval   = time.Second
	DefaultBatch      = 100
	DefaultMaxBackoff = 30 * time.Second
)

// RelayOptions configures a Relay. The zero value is usable.
type RelayOptions struct {
	// Interval is the pause between two rounds of Run, when no Kick comes.
	// Default DefaultInterval (1s).
	Interval time.Duration
	// Batch is the limit of each Take. Default DefaultBatch (100).
	Batch int
	// MaxBackoff caps the pause after failed rounds: after n rounds in a
	// row that sent nothing and failed, Run waits Interval·2ⁿ⁻¹, at most
	// MaxBackoff (and at least Interval). Default DefaultMaxBackoff (30s).
	MaxBackoff time.Duration
	// Logger receives a relay's errors and progress; event bodies are
	// never logged. Default slog.Default().
	Logger *slog.Logger
	// OnPass, if set, is called after every Take with what it returned.
	OnPass func(sent int, err error)
}

// Relay publishes a Table's unsent events through a Publisher. Run one in
// every instance of a service: their Takes share the work. Make one with
// NewRelay.
type Relay struct {
	t    Table
	p    Publisher
	o    RelayOptions
	kick chan struct{} // holds one pending Kick
}

// NewRelay returns a relay from t to p.
func NewRelay(t Table, p Publisher, o RelayOptions) *Relay {
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
	}
	if o.Batch <= 0 {
		o.Batch = DefaultBatch
	}
	if o.MaxBackoff <= 0 {
		o.MaxBackoff = DefaultMaxBackoff
	}
	o.MaxBackoff = max(o.MaxBackoff, o.Interval)
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return &Relay{t: t, p: p, o: o, kick: make(chan struct{}, 1)}
}

// Kick asks Run for a round at once (after an Add committed, say). It
// never blocks; kicks that come while a round runs make one more round.
// While Run backs off after failures, a kick waits for the backoff's end.
func (r *Relay) Kick() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// Run publishes in rounds until ctx ends: each round is RunOnce, and the
// next starts after Interval, on a Kick, or, after a round that failed
// without sending anything, after a backoff (see RelayOptions.MaxBackoff).
func (r *Relay) Run(ctx context.Context) {
	failures := 0
	for ctx.Err() == nil {
		sent, err := r.RunOnce(ctx)
		switch {
		case ctx.Err() != nil:
			return
		case err != nil && sent == 0:
			failures++
		default:
			failures = 0
		}
		if failures > 0 {
			wait := r.backoff(failures)
			r.o.Logger.WarnContext(ctx, "outbox relay: backing off", "failures", failures, "wait", wait)
			if !sleep(ctx, wait) {
				return
			}
			continue // a pending kick is served by this round
		}
		timer := time.NewTimer(r.o.Interval)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C:
		case <-r.kick:
			timer.Stop()
		}
	}
}

// backoff returns the pause after n failed rounds in a row.
func (r *Relay) backoff(n int) time.Duration {
	d := r.o.Interval
	for i := 1; i < n && d < r.o.MaxBackoff; i++ {
		d *= 2
	}
	return min(d, r.o.MaxBackoff)
}

// sleep waits d or until ctx ends, and reports whether ctx is still alive.
func sleep(ctx context.Context, d time.Duration) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-timer.C:
		return true
	}
}

// RunOnce takes batches until one sends nothing, and returns how many
// events it sent and the error of the last pass that failed (nil if none
// did). Passes go on after a failure as long as they send something, so
// an event that keeps failing holds back its own key only; events another
// relay holds are left to it. It stops at once when ctx ends.
func (r *Relay) RunOnce(ctx context.Context) (int, error) {
	// A Kick that came before this round is served by it.
	select {
	case <-r.kick:
	default:
	}
	total := 0
	var last error
	for {
		n, err := r.t.Take(ctx, r.o.Batch, r.p.Publish)
		total += n
		if r.o.OnPass != nil {
			r.o.OnPass(n, err)
		}
		if err != nil {
			last = err
			if ctx.Err() != nil { // stopping, not failing
				return total, err
			}
			r.o.Logger.ErrorContext(ctx, "outbox relay: pass failed", "sent", n, "err", err)
		}
		if n == 0 {
			if total > 0 {
				r.o.Logger.DebugContext(ctx, "outbox relay: round done", "sent", total)
			}
			return total, last
		}
	}
}
