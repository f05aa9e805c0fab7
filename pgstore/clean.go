package pgstore

import (
	"context"
	"time"

	"github.com/idem-go/idem/idemdriver"
)

// An idem.Cleaner of a Store deletes with Clean.
var _ idemdriver.ExpiredCleaner = (*Store)(nil)

// CleanOptions configures Store.Clean. The zero value is usable.
type CleanOptions struct {
	// BatchSize is how many keys one statement deletes at most. Default
	// 5000 (it was 1000). The server spends about 4 µs of CPU per deleted
	// key (BenchmarkCleaner), so a batch of 5000 takes about 20 ms of a
	// core and the Pause after it leaves a third of the time to other work;
	// a batch of 1000 took about 4 ms, and its pause held Clean below
	// 70,000 keys/s however idle the server. The rows of a batch stay
	// locked until its statement commits: a claim of one of those expired
	// keys (a client sending a key again after its expiry) waits for that;
	// nothing else does.
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
		o.BatchSize = 5000
	}
	if o.Pause <= 0 {
		o.Pause = 10 * time.Millisecond
	}
	return o
}

// deleteExpiredSQL deletes one batch of expired completed records ($2 at
// most, oldest expiry first; $1 the test clock or NULL) and returns how
// many it deleted and the latest expiry among them. $3, when not NULL, is
// where the batch starts in the order of expiry: only records that expire
// at $3 or later are candidates. See DeleteExpired.
const deleteExpiredSQL = `
WITH deleted AS (
	DELETE FROM idempotency_keys
	WHERE ctid = ANY(ARRAY(
		SELECT ctid
		FROM idempotency_keys
		WHERE response_status IS NOT NULL
			AND expires_at <= coalesce($1::timestamptz, statement_timestamp())
			AND expires_at >= coalesce($3::timestamptz, '-infinity'::timestamptz)
		ORDER BY expires_at
		LIMIT $2
		FOR UPDATE SKIP LOCKED
	))
	AND response_status IS NOT NULL AND expires_at <= coalesce($1::timestamptz, statement_timestamp())
	RETURNING expires_at
)
SELECT count(*), max(expires_at) FROM deleted`

// deleteExpired runs deleteExpiredSQL: up to limit expired completed
// records whose expiry is from or later (any, when from is nil). It
// returns how many it deleted and the latest expiry among them (zero when
// none).
func (s *Store) deleteExpired(ctx context.Context, limit int, from *time.Time) (int, time.Time, error) {
	if limit <= 0 {
		return 0, time.Time{}, nil
	}
	var (
		n    int64
		last *time.Time
	)
	if err := s.pool.QueryRow(ctx, s.q(deleteExpiredSQL), s.mode, s.at(), limit, from).Scan(&n, &last); err != nil {
		return 0, time.Time{}, interpretError(err)
	}
	if last == nil {
		return int(n), time.Time{}, nil
	}
	return int(n), *last, nil
}

// Clean deletes expired keys in batches, with DeleteExpired's statement,
// until a batch finds fewer than BatchSize to delete, and reports how many
// it deleted. It never deletes a record without a response, whatever its
// expiry (its attempt may have paid; the completer finishes it), nor waits
// for a row another transaction is writing (such rows are left to the next
// Clean). On error it returns the count so far with the error.
//
// Each batch after the first starts at the latest expiry the previous one
// deleted (that expiry included, for the keys that share it), instead of
// at the oldest: the index entries and row versions of the keys the round
// already deleted stay until a VACUUM removes them, and scanning them
// again made every batch slower than the one before (about three times
// the server's CPU per key over a backlog of 300,000 in
// BenchmarkCleaner, and more the larger the backlog). The conditions of
// a deletion are DeleteExpired's, checked by the same statement; only
// when a key goes may be later. A key whose expiry is already behind the
// batches' start when it can be deleted (a batch skipped it because
// another transaction held its row, or its attempt's completion committed
// during the round) is left to the next Clean, where before a later batch
// of the same Clean might have taken it.
func (s *Store) Clean(ctx context.Context, opts CleanOptions) (int, error) {
	opts = opts.withDefaults()
	total := 0
	var from *time.Time
	for {
		n, last, err := s.deleteExpired(ctx, opts.BatchSize, from)
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
		from = &last
		if err := sleep(ctx, opts.Pause); err != nil {
			return total, err
		}
	}
}

// CleanExpired implements idemdriver.ExpiredCleaner with Clean: an
// idem.Cleaner of s deletes with it, batch after batch, each starting
// where the previous one ended.
func (s *Store) CleanExpired(ctx context.Context, p idemdriver.CleanParams) (int, error) {
	return s.Clean(ctx, CleanOptions{BatchSize: p.Batch, Pause: p.Pause, Progress: p.Progress})
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
