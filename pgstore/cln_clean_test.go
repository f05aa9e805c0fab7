package pgstore_test

// Tests of Clean's batches that start where the previous one ended.

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/idem-go/idem/pgstore"
)

// clnInsert inserts n keys named prefix1 … prefixN, expiring at now + the
// given offset plus step × i, answered (201) or not.
func clnInsert(t *testing.T, b *testBundle, prefix string, n int, offset, step time.Duration, answered bool) {
	t.Helper()
	var status *int
	if answered {
		s := 201
		status = &s
	}
	if _, err := b.pool.Exec(context.Background(), `
INSERT INTO idempotency_keys
	(user_id, key, fingerprint, method, path, owner, lease_until, attempts, response_status, created_at, completed_at, expires_at)
SELECT 'u', $1 || g, 'fp', 'POST', '/', 'o', $2::timestamptz - interval '3 days', 1, $3::int,
	$2::timestamptz - interval '3 days', CASE WHEN $3::int IS NULL THEN NULL ELSE $2::timestamptz - interval '3 days' END,
	$2::timestamptz + $4::interval + $5::interval * g
FROM generate_series(1, $6::int) g`, prefix, b.clock.Now(), status, offset, step, n); err != nil {
		t.Fatalf("inserting %s keys: %v", prefix, err)
	}
}

func clnLeft(t *testing.T, b *testBundle, prefix string) int {
	t.Helper()
	var n int
	if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_keys WHERE key LIKE $1 || '%'`, prefix).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestClnCleanTiesAcrossBatches: keys that share one expiry across batch
// boundaries are all deleted (a batch starts at the previous one's latest
// expiry, that expiry included), and the keys Clean must keep, some with
// that same expiry, stay.
func TestClnCleanTiesAcrossBatches(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	clnInsert(t, b, "older", 700, -2*time.Hour, time.Second, true)
	clnInsert(t, b, "same", 2500, -time.Hour, 0, true)
	clnInsert(t, b, "newer", 300, -30*time.Minute, time.Second, true)
	clnInsert(t, b, "unanswered", 10, -time.Hour, 0, false)
	clnInsert(t, b, "live", 10, time.Microsecond, 0, true)

	var calls []int
	n, err := s.Clean(context.Background(), pgstore.CleanOptions{
		BatchSize: 1000,
		Pause:     time.Millisecond,
		Progress:  func(deleted int) { calls = append(calls, deleted) },
	})
	if err != nil {
		t.Fatalf("Clean: %v", err)
	}
	if n != 3500 {
		t.Errorf("Clean = %d, want 3500", n)
	}
	if want := []int{1000, 2000, 3000, 3500}; !slices.Equal(calls, want) {
		t.Errorf("progress %v, want %v", calls, want)
	}
	for _, c := range []struct {
		prefix string
		want   int
	}{{"older", 0}, {"same", 0}, {"newer", 0}, {"unanswered", 10}, {"live", 10}} {
		if got := clnLeft(t, b, c.prefix); got != c.want {
			t.Errorf("%d %s keys left, want %d", got, c.prefix, c.want)
		}
	}
}

// TestClnCleanSkipsHeldRow: a key whose row another transaction holds is
// skipped without waiting, although its expiry comes before every batch's
// start; the next Clean, once the row is free, deletes it.
func TestClnCleanSkipsHeldRow(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	clnInsert(t, b, "held", 1, -3*time.Hour, 0, true)
	clnInsert(t, b, "expired", 2500, -2*time.Hour, time.Second, true)

	tx, err := b.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var key string
	if err := tx.QueryRow(ctx, `SELECT key FROM idempotency_keys WHERE key = 'held1' FOR UPDATE`).Scan(&key); err != nil {
		t.Fatalf("locking held1: %v", err)
	}

	// Were Clean to wait for the row, it would wait until this context
	// ends, as the transaction ends only after Clean returns.
	cctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	n, err := s.Clean(cctx, pgstore.CleanOptions{BatchSize: 1000, Pause: time.Millisecond})
	if err != nil {
		t.Fatalf("Clean while a row is held: %v", err)
	}
	if n != 2500 {
		t.Errorf("Clean while a row is held = %d, want 2500", n)
	}
	if got := clnLeft(t, b, "held"); got != 1 {
		t.Errorf("held key left: %d, want 1", got)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Clean(ctx, pgstore.CleanOptions{BatchSize: 1000, Pause: time.Millisecond}); err != nil || n != 1 {
		t.Errorf("Clean once the row is free = %d, %v; want 1", n, err)
	}
	if got := clnLeft(t, b, ""); got != 0 {
		t.Errorf("%d keys left, want 0", got)
	}
}

// TestClnCleanDefaults: Clean with the zero options deletes a backlog
// larger than one default batch, in batches of the default size.
func TestClnCleanDefaults(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	clnInsert(t, b, "expired", 12000, -2*time.Hour, time.Millisecond, true)
	batches := 0
	n, err := s.Clean(context.Background(), pgstore.CleanOptions{Progress: func(int) { batches++ }})
	if err != nil || n != 12000 {
		t.Fatalf("Clean = %d, %v; want 12000", n, err)
	}
	if batches != 3 {
		t.Errorf("%d batches, want 3 (5000, 5000, 2000)", batches)
	}
	if got := clnLeft(t, b, ""); got != 0 {
		t.Errorf("%d keys left, want 0", got)
	}
}
