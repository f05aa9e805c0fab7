package idemdriver

import (
	"context"
	"time"
)

// ExpiredCleaner is implemented by stores that have a faster way to delete
// every expired key than DeleteExpired called batch after batch (pgstore:
// each batch starts where the previous one ended). A Cleaner whose Sweeper
// implements it uses it instead of DeleteExpired.
type ExpiredCleaner interface {
	// CleanExpired deletes the records that DeleteExpired would delete,
	// and only those: completed records whose expiry passed, never a
	// record without a response. It deletes them in batches of at most
	// p.Batch with p.Pause between two, until a batch deletes fewer than
	// p.Batch or ctx is done, calls p.Progress (if set) after each batch
	// with the running total, and reports how many it deleted; on error,
	// the count so far with the error.
	CleanExpired(ctx context.Context, p CleanParams) (int, error)
}

// CleanParams are the batches of a sweep; see ExpiredCleaner.
type CleanParams struct {
	Batch    int // > 0
	Pause    time.Duration
	Progress func(deleted int) // nil: none
}
