package pgstore_test

// Adversarial tests of Clean's batches that start at the previous batch's
// latest expiry, under real concurrency: completions that extend an expiry,
// replaces of expired records by new claims, takeovers, rows held by other
// transactions, ties on expires_at and several cleaning instances at once.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/storetest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// cleanRaceGuard installs a BEFORE DELETE trigger that records every deletion of
// a record without a response or not yet expired by the deleting
// statement's clock (the database's).
func cleanRaceGuard(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `
CREATE TABLE adv3_violations (key text, status int, expires_at timestamptz, at timestamptz);
CREATE FUNCTION adv3_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	IF OLD.response_status IS NULL OR OLD.expires_at > statement_timestamp() THEN
		INSERT INTO adv3_violations VALUES (OLD.key, OLD.response_status, OLD.expires_at, statement_timestamp());
	END IF;
	RETURN OLD;
END $$;
CREATE TRIGGER adv3_guard BEFORE DELETE ON idempotency_keys FOR EACH ROW EXECUTE FUNCTION adv3_guard();
CREATE TABLE adv3_replaces (key text);
CREATE FUNCTION adv3_replace() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO adv3_replaces VALUES (NEW.key);
	RETURN NEW;
END $$;
CREATE TRIGGER adv3_replace AFTER UPDATE ON idempotency_keys FOR EACH ROW
	WHEN (OLD.response_status IS NOT NULL AND NEW.response_status IS NULL) EXECUTE FUNCTION adv3_replace();`); err != nil {
		t.Fatalf("installing the guard: %v", err)
	}
}

// cleanRacePool opens a second pool on pool's schema whose statements
// fail after waiting 300ms for a lock: a Clean that waits on a row another
// transaction holds (the holders below keep theirs 400ms) returns an error.
func cleanRacePool(t *testing.T, pool *pgxpool.Pool) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	var schema string
	if err := pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["lock_timeout"] = "300ms"
	cfg.MaxConns = 4
	cp, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cp.Close)
	return cp
}

// TestCleanRacesClaimsCompletionsTakeovers runs four cleaning instances
// in a loop, with small batches, against attempts whose records expire
// while they run (their completion extends the expiry), claims that replace
// expired records, takeovers of attempts whose lease ran out, holders of
// expired completed rows, and batches of expired keys sharing one expiry.
// No deletion may take a record without a response or before its expiry by
// the deleting statement's clock; no Clean may wait on a row; and once
// everything stops, one Clean leaves no expired completed key.
func TestCleanRacesClaimsCompletionsTakeovers(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, pgtest.MaxConns(12))
	ctx := context.Background()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	cleanRaceGuard(t, pool)
	if _, err := pool.Exec(ctx, `CREATE TABLE adv3_effects (name text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	s := pgstore.New(pool, pgstore.Options{})
	cleaners := pgstore.New(cleanRacePool(t, pool), pgstore.Options{})

	const keys = 30
	// The workload runs for 4 s, and on until it has exercised every race
	// it is here for (a completion, a clean, a fenced attempt, a replaced
	// expired record), at most 30 s: under load a fenced attempt can take
	// longer to happen.
	soft, hard := time.Now().Add(4*time.Second), time.Now().Add(30*time.Second)
	var stop atomic.Bool
	running := func() bool { return !stop.Load() }
	var (
		wg                                         sync.WaitGroup
		cleaned, completed, replaced, fenced, errs atomic.Int64
		firstErr                                   sync.Once
		errMsg                                     atomic.Value
	)
	fail := func(format string, a ...any) {
		errs.Add(1)
		firstErr.Do(func() { errMsg.Store(fmt.Sprintf(format, a...)) })
	}

	// Attempts: claim, hold the row in the handler's transaction, run past
	// the TTL (sometimes past the lease), complete.
	for w := 0; w < 5; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 3))
			for running() {
				key := fmt.Sprintf("k%d", r.IntN(keys))
				lease := 2 * time.Second
				if w == 0 {
					lease = 30 * time.Millisecond // taken over by the others
				}
				c, err := s.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: key, Fingerprint: "fp", Owner: idemdriver.NewOwner(),
					Method: "POST", Path: "/", Lease: lease, TTL: 20 * time.Millisecond})
				if err != nil || c.Lease == nil {
					time.Sleep(time.Millisecond) // not waiting for an outcome: a worker's pause before its next try, until the deadline
					continue
				}
				if c.Lease.Attempt == 1 {
					replaced.Add(1)
				}
				tx, err := s.Begin(ctx, c.Lease)
				if err != nil {
					fail("Begin: %v", err)
					continue
				}
				ptx := tx.(*pgstore.Tx).PgxTx()
				if _, err := ptx.Exec(ctx, `INSERT INTO adv3_effects VALUES ($1)`, key); err != nil {
					tx.Rollback(ctx)
					fail("handler write: %v", err)
					continue
				}
				time.Sleep(time.Duration(r.IntN(60)) * time.Millisecond) // not waiting for an outcome: the handler's work takes a random while, by design
				err = tx.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte(key)})
				switch {
				case err == nil:
					completed.Add(1)
				case errors.Is(err, idem.ErrFenced):
					fenced.Add(1)
				default:
					fail("Complete: %v", err)
				}
			}
		}(w)
	}

	// Holders of expired completed rows: Clean must skip them, not wait.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for running() {
			tx, err := pool.Begin(ctx)
			if err != nil {
				fail("holder: %v", err)
				return
			}
			if _, err := tx.Exec(ctx, `SELECT 1 FROM idempotency_keys WHERE response_status IS NOT NULL AND expires_at <= statement_timestamp()
				ORDER BY expires_at LIMIT 7 FOR UPDATE SKIP LOCKED`); err != nil {
				fail("holder: %v", err)
				tx.Rollback(ctx)
				return
			}
			time.Sleep(400 * time.Millisecond) // not waiting for an outcome: the holder keeps its row locks a while, by design
			tx.Rollback(ctx)
		}
	}()

	// Backlog: expired completed keys, 40 sharing one expiry each time.
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; running(); i++ {
			if _, err := pool.Exec(ctx, `
INSERT INTO idempotency_keys
	(user_id, key, fingerprint, method, path, owner, lease_until, attempts, response_status, created_at, completed_at, expires_at)
SELECT 'b', $1::text || '_' || g, 'fp', 'POST', '/', 'o', now() - interval '1 hour', 1, 201,
	now() - interval '1 hour', now() - interval '1 hour', date_trunc('milliseconds', statement_timestamp()) - interval '1 millisecond'
FROM generate_series(1, 40) g`, fmt.Sprintf("b%d", i)); err != nil {
				fail("backlog: %v", err)
			}
			time.Sleep(20 * time.Millisecond) // not waiting for an outcome: paces the backlog's inserts
		}
	}()

	for c := 0; c < 4; c++ {
		wg.Add(1)
		go func(c int) {
			defer wg.Done()
			for running() {
				n, err := cleaners.Clean(ctx, pgstore.CleanOptions{BatchSize: 3 + c, Pause: time.Microsecond})
				cleaned.Add(int64(n))
				if err != nil {
					fail("Clean: %v", err)
				}
				time.Sleep(time.Duration(c) * 5 * time.Millisecond) // not waiting for an outcome: paces each cleaner differently
			}
		}(c)
	}
	// Stop the workload once it has run its time and covered every race.
	covered := func() bool {
		var replaces int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM adv3_replaces`).Scan(&replaces); err != nil {
			return false
		}
		return completed.Load() > 0 && cleaned.Load() > 0 && fenced.Load() > 0 && replaces > 0
	}
	for time.Now().Before(soft) || (time.Now().Before(hard) && !covered()) {
		time.Sleep(50 * time.Millisecond) // not waiting for an outcome: the workload's minimum run; coverage is polled, bounded by hard
	}
	stop.Store(true)
	wg.Wait()

	if n := errs.Load(); n > 0 {
		t.Errorf("%d errors, first: %v", n, errMsg.Load())
	}
	var violations []string
	rows, err := pool.Query(ctx, `SELECT format('%s status=%s expires_at=%s at=%s', key, status, expires_at, at) FROM adv3_violations`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			t.Fatal(err)
		}
		violations = append(violations, v)
	}
	if len(violations) > 0 {
		t.Errorf("%d deletions of unanswered or unexpired records, e.g. %v", len(violations), violations[:min(5, len(violations))])
	}
	t.Logf("cleaned %d, completed %d, new operations %d, fenced %d", cleaned.Load(), completed.Load(), replaced.Load(), fenced.Load())
	var replaces int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM adv3_replaces`).Scan(&replaces); err != nil {
		t.Fatal(err)
	}
	t.Logf("replaces of expired records by a new claim: %d", replaces)
	if completed.Load() == 0 || cleaned.Load() == 0 || fenced.Load() == 0 || replaces == 0 {
		t.Errorf("the workload did not exercise the races")
	}

	// Liveness: once everything stopped, one Clean leaves no key that was
	// expired and completed when it started.
	time.Sleep(50 * time.Millisecond) // not waiting for an outcome: lets the database's clock expire the last short-TTL keys, for more to clean
	var start time.Time
	if err := pool.QueryRow(ctx, `SELECT statement_timestamp()`).Scan(&start); err != nil {
		t.Fatal(err)
	}
	if _, err := cleaners.Clean(ctx, pgstore.CleanOptions{BatchSize: 5, Pause: time.Microsecond}); err != nil {
		t.Fatal(err)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE response_status IS NOT NULL AND expires_at <= $1`, start).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("%d expired completed keys left after a Clean in quiet", left)
	}
}

// TestCleanTestClockMicrosecondTies: with a test clock whose time has
// nanoseconds, keys expiring exactly at that time truncated to the
// microsecond are expired, those one microsecond later are not; many
// instances cleaning at once in batches smaller than the ties delete each
// expired key exactly once and keep the others.
func TestCleanTestClockMicrosecondTies(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t, pgtest.MaxConns(10))
	ctx := context.Background()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatal(err)
	}
	base := time.Date(2030, 1, 2, 3, 4, 5, 123456000, time.UTC)
	clock := storetest.NewClock(base.Add(999 * time.Nanosecond))
	ins := func(prefix string, n int, expires time.Time, status any) {
		if _, err := pool.Exec(ctx, `
INSERT INTO idempotency_keys
	(user_id, key, fingerprint, method, path, owner, lease_until, attempts, response_status, created_at, completed_at, expires_at)
SELECT 'u', $1::text || g, 'fp', 'POST', '/', 'o', $2::timestamptz - interval '1 day', 1, $4::int,
	$2::timestamptz - interval '1 day', $2::timestamptz - interval '1 day', $3::timestamptz
FROM generate_series(1, $5::int) g`, prefix, base, expires, status, n); err != nil {
			t.Fatal(err)
		}
	}
	ins("old", 37, base.Add(-time.Microsecond), 201)
	ins("tie", 523, base, 201)
	ins("next", 41, base.Add(time.Microsecond), 201)
	ins("open", 13, base.Add(-time.Hour), nil)

	var (
		wg    sync.WaitGroup
		total atomic.Int64
	)
	for i := 0; i < 6; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			s := pgstore.New(pool, pgstore.Options{Now: clock.Now})
			n, err := s.Clean(ctx, pgstore.CleanOptions{BatchSize: 5 + i*3, Pause: time.Microsecond})
			if err != nil {
				t.Errorf("Clean: %v", err)
			}
			total.Add(int64(n))
		}(i)
	}
	wg.Wait()
	// Concurrent rounds may each end on a short batch while others still
	// hold rows; a later Clean deletes what is left.
	s := pgstore.New(pool, pgstore.Options{Now: clock.Now})
	n, err := s.Clean(ctx, pgstore.CleanOptions{BatchSize: 7, Pause: time.Microsecond})
	if err != nil {
		t.Fatal(err)
	}
	total.Add(int64(n))
	if got := total.Load(); got != 37+523 {
		t.Errorf("deleted %d in all, want %d", got, 37+523)
	}
	for prefix, want := range map[string]int{"old": 0, "tie": 0, "next": 41, "open": 13} {
		var got int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE key LIKE $1 || '%'`, prefix).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("%d %s keys left, want %d", got, prefix, want)
		}
	}
}
