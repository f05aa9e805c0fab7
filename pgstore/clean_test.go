package pgstore_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
)

// insertExpired inserts 10,000 expired completed keys, and 30 keys that
// Clean must keep: 10 live completed keys and 20 expired keys without a
// response (10 still leased, 10 abandoned), which the completer must still
// be able to finish.
func insertExpired(t *testing.T, b *testBundle) {
	t.Helper()
	ctx := context.Background()
	now := b.clock.Now()
	if _, err := b.pool.Exec(ctx, `
INSERT INTO idempotency_keys
	(user_id, key, fingerprint, method, path, owner, lease_until, attempts,
	 response_status, created_at, completed_at, expires_at)
SELECT 'u' || (g % 7), 'k' || g, 'fp', 'POST', '/v1/orders', md5(g::text), $1::timestamptz - interval '1 day', 1,
	201, $1::timestamptz - interval '2 days', $1::timestamptz - interval '2 days',
	$1::timestamptz - make_interval(secs => g)
FROM generate_series(1, 10000) g`, now); err != nil {
		t.Fatalf("inserting expired keys: %v", err)
	}
	if _, err := b.pool.Exec(ctx, `
INSERT INTO idempotency_keys
	(user_id, key, fingerprint, method, path, owner, lease_until, attempts, response_status, created_at, expires_at)
SELECT 'u', 'leased' || g, 'fp', 'POST', '/', 'o', $1::timestamptz + interval '1 minute', 1, NULL::int, $1::timestamptz - interval '1 hour', $1::timestamptz - make_interval(secs => 20000 + g)
FROM generate_series(1, 10) g
UNION ALL
SELECT 'u', 'abandoned' || g, 'fp', 'POST', '/', 'o', $1::timestamptz - interval '1 minute', 3, NULL, $1::timestamptz - interval '1 hour', $1::timestamptz - make_interval(secs => 20000 + g)
FROM generate_series(1, 10) g
UNION ALL
SELECT 'u', 'live' || g, 'fp', 'POST', '/', 'o', $1::timestamptz - interval '1 minute', 1, 201, $1, $1::timestamptz + interval '1 hour'
FROM generate_series(1, 10) g`, now); err != nil {
		t.Fatalf("inserting kept keys: %v", err)
	}
}

// kept counts the keys left, and those of them that Clean must keep.
func kept(t *testing.T, b *testBundle) (all, keep int) {
	t.Helper()
	ctx := context.Background()
	if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&all); err != nil {
		t.Fatal(err)
	}
	if err := b.pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE key LIKE 'leased%' OR key LIKE 'abandoned%' OR key LIKE 'live%'`).Scan(&keep); err != nil {
		t.Fatal(err)
	}
	return all, keep
}

func TestClean(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	insertExpired(t, b)

	var progress []int
	start := time.Now()
	n, err := s.Clean(ctx, pgstore.CleanOptions{
		BatchSize: 1000,
		Pause:     time.Millisecond,
		Progress:  func(deleted int) { progress = append(progress, deleted) },
	})
	if err != nil {
		t.Fatalf("Clean: %v", err)
	}
	t.Logf("Clean deleted %d keys in %v", n, time.Since(start))
	if n != 10000 {
		t.Errorf("Clean = %d, want 10000", n)
	}
	if len(progress) < 10 || progress[0] != 1000 || progress[len(progress)-1] != 10000 {
		t.Errorf("progress = %v, want 1000, 2000, … 10000", progress)
	}
	if all, left := kept(t, b); left != 30 || all != 30 {
		t.Errorf("left %d keys (%d to keep), want the 30 unanswered or live ones", all, left)
	}
	if n, err := s.Clean(ctx, pgstore.CleanOptions{}); err != nil || n != 0 {
		t.Errorf("second Clean = %d, %v; want 0", n, err)
	}
}

// TestCleanConcurrently runs cleaners side by side, as instances do: their
// batches skip each other's rows and together delete every expired key once.
func TestCleanConcurrently(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	insertExpired(t, b)
	var total atomic.Int64
	var wg sync.WaitGroup
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, err := s.Clean(context.Background(), pgstore.CleanOptions{BatchSize: 500, Pause: time.Millisecond})
			if err != nil {
				t.Errorf("Clean: %v", err)
			}
			total.Add(int64(n))
		}()
	}
	wg.Wait()
	if total.Load() != 10000 {
		t.Errorf("deleted %d keys in all, want 10000", total.Load())
	}
	if all, left := kept(t, b); left != 30 || all != 30 {
		t.Errorf("left %d keys (%d to keep), want the 30 unanswered or live ones", all, left)
	}
}

func TestCleanerRun(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	p := params("u1", "k1", "fp1")
	p.TTL, p.Lease = time.Second, time.Millisecond
	if err := begin(t, s, lease(t, s, p), "cleaner").Complete(context.Background(), response("done")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	b.clock.Advance(2 * time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	// idem.Cleaner over the store deletes with Clean (idemdriver.ExpiredCleaner).
	c := idem.NewCleaner(s, idem.CleanerOptions{Interval: time.Hour,
		Progress: func(deleted int) {
			if deleted == 1 {
				cancel()
			}
		},
	})
	go func() { c.Run(ctx); done <- ctx.Err() }()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Run = %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		cancel()
		t.Fatal("Cleaner did not delete the expired key")
	}
}

// Clean's batches start where the previous one ended.

// insertExpiring inserts n keys named prefix1 … prefixN, expiring at now + the
// given offset plus step × i, answered (201) or not.
func insertExpiring(t *testing.T, b *testBundle, prefix string, n int, offset, step time.Duration, answered bool) {
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

func keysLeft(t *testing.T, b *testBundle, prefix string) int {
	t.Helper()
	var n int
	if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_keys WHERE key LIKE $1 || '%'`, prefix).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestCleanTiesAcrossBatches: keys that share one expiry across batch
// boundaries are all deleted (a batch starts at the previous one's latest
// expiry, that expiry included), and the keys Clean must keep, some with
// that same expiry, stay.
func TestCleanTiesAcrossBatches(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	insertExpiring(t, b, "older", 700, -2*time.Hour, time.Second, true)
	insertExpiring(t, b, "same", 2500, -time.Hour, 0, true)
	insertExpiring(t, b, "newer", 300, -30*time.Minute, time.Second, true)
	insertExpiring(t, b, "unanswered", 10, -time.Hour, 0, false)
	insertExpiring(t, b, "live", 10, time.Microsecond, 0, true)

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
		if got := keysLeft(t, b, c.prefix); got != c.want {
			t.Errorf("%d %s keys left, want %d", got, c.prefix, c.want)
		}
	}
}

// TestCleanSkipsHeldRow: a key whose row another transaction holds is
// skipped without waiting, although its expiry comes before every batch's
// start; the next Clean, once the row is free, deletes it.
func TestCleanSkipsHeldRow(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	insertExpiring(t, b, "held", 1, -3*time.Hour, 0, true)
	insertExpiring(t, b, "expired", 2500, -2*time.Hour, time.Second, true)

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
	if got := keysLeft(t, b, "held"); got != 1 {
		t.Errorf("held key left: %d, want 1", got)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := s.Clean(ctx, pgstore.CleanOptions{BatchSize: 1000, Pause: time.Millisecond}); err != nil || n != 1 {
		t.Errorf("Clean once the row is free = %d, %v; want 1", n, err)
	}
	if got := keysLeft(t, b, ""); got != 0 {
		t.Errorf("%d keys left, want 0", got)
	}
}

// TestCleanDefaults: Clean with the zero options deletes a backlog
// larger than one default batch, in batches of the default size.
func TestCleanDefaults(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	insertExpiring(t, b, "expired", 12000, -2*time.Hour, time.Millisecond, true)
	batches := 0
	n, err := s.Clean(context.Background(), pgstore.CleanOptions{Progress: func(int) { batches++ }})
	if err != nil || n != 12000 {
		t.Fatalf("Clean = %d, %v; want 12000", n, err)
	}
	if batches != 3 {
		t.Errorf("%d batches, want 3 (5000, 5000, 2000)", batches)
	}
	if got := keysLeft(t, b, ""); got != 0 {
		t.Errorf("%d keys left, want 0", got)
	}
}
