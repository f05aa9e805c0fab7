package idem

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/idem-go/idem/idemdriver"
)

// Defaults of CleanerOptions.
const (
	DefaultCleanInterval = time.Minute
	DefaultCleanBatch    = 1000
	DefaultCleanPause    = 10 * time.Millisecond
)

// CleanerOptions configures a Cleaner. The zero value is usable.
type CleanerOptions struct {
	// Interval is the time between the starts of two of Run's sweeps.
	// Default DefaultCleanInterval.
	Interval time.Duration
	// Batch is how many keys one batch deletes at most. Default
	// DefaultCleanBatch.
	Batch int
	// Pause is the wait between two batches of a sweep, which leaves the
	// database to the requests. Default DefaultCleanPause.
	Pause time.Duration
	// Logger receives the outcome of Run's sweeps that deleted keys or
	// failed. Default slog.Default(). A caller that logs from OnSweep
	// gives slog.New(slog.DiscardHandler).
	Logger *slog.Logger
	// OnSweep, if set, is called at the end of every sweep (RunOnce's, and
	// so Run's) with what it did and its error, from the sweeping
	// goroutine: for metrics. The error is ctx's when the sweep was cut
	// short because ctx is done. It must return quickly.
	OnSweep func(ctx context.Context, st CleanerStats, err error)
	// Progress, if set, is called after each batch of a sweep with the
	// number of keys the sweep deleted so far, from the sweeping
	// goroutine. It must return quickly.
	Progress func(deleted int)
	// Now reads the clock for CleanerStats.Took. Default time.Now.
	Now func() time.Time
}

// CleanerStats is what one sweep did.
type CleanerStats struct {
	Deleted int           // expired keys deleted
	Took    time.Duration // from the sweep's start to its end, by CleanerOptions.Now
}

func (o CleanerOptions) withDefaults() CleanerOptions {
	if o.Interval <= 0 {
		o.Interval = DefaultCleanInterval
	}
	if o.Batch <= 0 {
		o.Batch = DefaultCleanBatch
	}
	if o.Pause <= 0 {
		o.Pause = DefaultCleanPause
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return o
}

// Cleaner deletes a store's expired keys in batches: once (RunOnce, as
// `orders gc` does) or at start and then every Interval (Run, a service's
// background cleaner). It deletes only what the store's DeleteExpired
// deletes, so never a key without a response (its attempt may have paid;
// the completer finishes it) nor a live one. Every instance of a service
// may run one.
type Cleaner struct {
	sweeper idemdriver.Sweeper
	opts    CleanerOptions
}

// NewCleaner returns a cleaner of sweeper's expired keys, which uses
// sweeper's CleanExpired if it implements ExpiredCleaner, and its
// DeleteExpired batch after batch otherwise.
func NewCleaner(sweeper idemdriver.Sweeper, opts CleanerOptions) *Cleaner {
	if sweeper == nil {
		panic("idem.NewCleaner: nil Sweeper")
	}
	if err := opts.check(); err != nil {
		panic("idem.NewCleaner: " + err.Error())
	}
	return &Cleaner{sweeper: sweeper, opts: opts.withDefaults()}
}

// check reports the first of o's fields that NewCleaner refuses.
func (o CleanerOptions) check() error {
	for _, d := range [...]struct {
		name string
		v    time.Duration
	}{{"Interval", o.Interval}, {"Pause", o.Pause}} {
		if d.v < 0 {
			return fmt.Errorf("invalid CleanerOptions.%s %v: negative (zero means the default)", d.name, d.v)
		}
	}
	if o.Batch < 0 {
		return fmt.Errorf("invalid CleanerOptions.Batch %d: negative (zero means the default)", o.Batch)
	}
	return nil
}

// Run sweeps at once and then every Interval until ctx is done. A failed
// sweep is logged and tried again at the next interval.
func (c *Cleaner) Run(ctx context.Context) {
	t := time.NewTicker(c.opts.Interval)
	defer t.Stop()
	for {
		n, err := c.RunOnce(ctx)
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			c.opts.Logger.WarnContext(ctx, "idem: cleaner failed to delete expired keys", "deleted", n, "err", err)
		case n > 0:
			c.opts.Logger.InfoContext(ctx, "idem: cleaner deleted expired keys", "count", n)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// RunOnce deletes the expired keys in batches of Batch, with Pause between
// two, until a batch deletes fewer than Batch or ctx is done, and reports
// how many it deleted; on error, the count so far with the error. Keys
// that expire while it runs may be left to the next sweep.
func (c *Cleaner) RunOnce(ctx context.Context) (int, error) {
	start := c.opts.Now()
	n, err := c.sweep(ctx)
	if c.opts.OnSweep != nil {
		c.opts.OnSweep(ctx, CleanerStats{Deleted: n, Took: c.opts.Now().Sub(start)}, err)
	}
	return n, err
}

func (c *Cleaner) sweep(ctx context.Context) (int, error) {
	if ec, ok := c.sweeper.(idemdriver.ExpiredCleaner); ok {
		return ec.CleanExpired(ctx, idemdriver.CleanParams{Batch: c.opts.Batch, Pause: c.opts.Pause, Progress: c.opts.Progress})
	}
	total := 0
	for {
		n, err := c.sweeper.DeleteExpired(ctx, c.opts.Batch)
		total += n
		if err != nil {
			return total, err
		}
		if c.opts.Progress != nil {
			c.opts.Progress(total)
		}
		if n < c.opts.Batch {
			return total, nil
		}
		if err := pause(ctx, c.opts.Pause); err != nil {
			return total, err
		}
	}
}

// pause waits for d or until ctx is done, and returns ctx's error then.
func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
