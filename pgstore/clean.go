package pgstore

import (
	"context"
	"log/slog"
	"time"
)

// CleanOptions configures Store.Clean. The zero value is usable.
type CleanOptions struct {
	// BatchSize is how many keys one statement deletes at most. Default 1000.
	BatchSize int
	// Pause is the wait between two batches, which leaves room to other
	// writers. Default 10ms.
	Pause time.Duration
	// Progress, if set, is called after each batch with the number of keys
	// deleted so far.
	Progress func(deleted int)
}

func (o CleanOptions) withDefaults() CleanOptions {
	if o.BatchSize <= 0 {
		o.BatchSize = 1000
	}
	if o.Pause <= 0 {
		o.Pause = 10 * time.Millisecond
	}
	return o
}

// Clean deletes expired keys in batches of DeleteExpired until a batch
// finds fewer than BatchSize to delete, and reports how many it deleted.
// It never deletes a record without a response, whatever its expiry (its
// attempt may have paid; the completer finishes it), nor waits for a row
// another transaction is writing (such rows are left to the next Clean). On error it returns the count so far with the error.
func (s *Store) Clean(ctx context.Context, opts CleanOptions) (int, error) {
	opts = opts.withDefaults()
	total := 0
	for {
		n, err := s.DeleteExpired(ctx, opts.BatchSize)
		if err != nil {
			return total, err
		}
		total += n
		if opts.Progress != nil {
			opts.Progress(total)
		}
		if n < opts.BatchSize {
			return total, nil
		}
		if err := sleep(ctx, opts.Pause); err != nil {
			return total, err
		}
	}
}

// Cleaner runs Store.Clean periodically: the background cleaner of an
// order service instance. Every instance may run one; their batches skip
// each other's rows.
type Cleaner struct {
	// Store is the store to clean. Required.
	Store *Store
	// Interval is the time between two rounds. Default one minute.
	Interval time.Duration
	// Options configures each round.
	Options CleanOptions
	// Logger receives the outcome of rounds that deleted keys or failed.
	// Default slog.Default().
	Logger *slog.Logger
}

// Run cleans at once and then every Interval until ctx is done; it returns
// ctx's error. A failed round is logged and retried at the next interval.
func (c *Cleaner) Run(ctx context.Context) error {
	interval := c.Interval
	if interval <= 0 {
		interval = time.Minute
	}
	logger := c.Logger
	if logger == nil {
		logger = slog.Default()
	}
	for {
		n, err := c.Store.Clean(ctx, c.Options)
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case err != nil:
			logger.WarnContext(ctx, "pgstore: cleaning expired keys failed", "deleted", n, "err", err)
		case n > 0:
			logger.InfoContext(ctx, "pgstore: deleted expired keys", "deleted", n)
		}
		if err := sleep(ctx, interval); err != nil {
			return err
		}
	}
}

// sleep waits for d or until ctx is done, and returns ctx's error then.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
