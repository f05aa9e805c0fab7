package pgstore_test

import (
	"context"
	"errors"
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
