package pgstore_test

// A completer's claim (ClaimParams.Redrive) takes only the operation it
// listed, and only while it is due (the lead's spec, after the fifth
// review); the fifth review's findings on pgstore (a sub-microsecond
// backoff, a migration that stalls every claim behind a reader).

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"testing/fstest"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5/pgconn"
)

// redriveOf is the claim of a completer that listed rec, with budget and
// backoff due.
func redriveOf(rec *idemdriver.Record, due idemdriver.AbandonedParams) idemdriver.ClaimParams {
	p := params(rec.User, rec.Key, rec.Fingerprint)
	p.Lease = time.Second
	p.Owner = idemdriver.NewOwner()
	p.Redrive = &idemdriver.RedriveParams{CreatedAt: rec.CreatedAt, Due: due}
	return p
}

// unchanged fails t unless (user, key) still holds want's attempt.
func unchanged(t *testing.T, s *pgstore.Store, want *idemdriver.Record, step string) {
	t.Helper()
	got := get(t, s, want.User, want.Key)
	if got.Owner != want.Owner || got.Attempts != want.Attempts || got.Redrives != want.Redrives ||
		!got.LeaseUntil.Equal(want.LeaseUntil) || !got.CreatedAt.Equal(want.CreatedAt) || (got.Response == nil) != (want.Response == nil) {
		t.Errorf("%s: record changed: owner %s attempts %d redrives %d lease %v created %v; was %s %d %d %v %v",
			step, got.Owner, got.Attempts, got.Redrives, got.LeaseUntil, got.CreatedAt,
			want.Owner, want.Attempts, want.Redrives, want.LeaseUntil, want.CreatedAt)
	}
}

// TestRedriveClaimRules: each rule of a completer's claim, in order.
func TestRedriveClaimRules(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	due := idemdriver.AbandonedParams{MaxRedrives: 3, Backoff: 10 * time.Second, MaxBackoff: time.Minute}

	p := params("u", "k", "fp")
	p.Lease = time.Second
	first := lease(t, s, p)
	listed := get(t, s, "u", "k")

	// Live lease: in flight, nothing changed.
	if _, err := s.Claim(ctx, redriveOf(listed, due)); !errors.Is(err, idem.ErrInFlight) {
		t.Errorf("live lease: %v, want ErrInFlight", err)
	}
	// Another fingerprint: mismatch, before anything else is decided.
	q := redriveOf(listed, due)
	q.Fingerprint = "other"
	if _, err := s.Claim(ctx, q); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Errorf("other fingerprint: %v, want ErrFingerprintMismatch", err)
	}
	// Another operation (another created_at) on the key: not due.
	other := *listed
	other.CreatedAt = listed.CreatedAt.Add(-time.Microsecond)
	b.clock.Advance(2 * time.Second)
	if _, err := s.Claim(ctx, redriveOf(&other, due)); !errors.Is(err, idem.ErrNotDue) {
		t.Errorf("other created_at: %v, want ErrNotDue", err)
	}
	unchanged(t, s, listed, "other created_at")

	// Lease ran out, never re-driven: due at once; counted.
	r1 := redriveOf(listed, due)
	c, err := s.Claim(ctx, r1)
	if err != nil || c.Lease == nil || c.Lease.Attempt != 2 || !c.Lease.CreatedAt.Equal(listed.CreatedAt) {
		t.Fatalf("due redrive = %+v, %v; want attempt 2 of the same operation", c, err)
	}
	if rec := get(t, s, "u", "k"); rec.Redrives != 1 || rec.Attempts != 2 || rec.Owner != r1.Owner {
		t.Errorf("after the takeover: redrives %d attempts %d owner %s; want 1, 2, %s", rec.Redrives, rec.Attempts, rec.Owner, r1.Owner)
	}
	// Own owner, resent: the same lease, counted once.
	c2, err := s.Claim(ctx, r1)
	if err != nil || c2.Lease == nil || *c2.Lease != *c.Lease {
		t.Errorf("resent = %+v, %v; want %+v", c2, err, c.Lease)
	}
	// The first attempt is fenced.
	if err := s.Fail(ctx, first); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("first attempt's Fail: %v, want ErrFenced", err)
	}

	// Re-driven once, its lease ended: in its 10s backoff.
	if err := s.Fail(ctx, c.Lease); err != nil {
		t.Fatal(err)
	}
	ended := get(t, s, "u", "k")
	b.clock.Advance(10*time.Second - time.Microsecond)
	if _, err := s.Claim(ctx, redriveOf(listed, due)); !errors.Is(err, idem.ErrNotDue) {
		t.Errorf("in its backoff: %v, want ErrNotDue", err)
	}
	unchanged(t, s, ended, "in its backoff")
	b.clock.Advance(time.Microsecond)
	if c, err := s.Claim(ctx, redriveOf(listed, due)); err != nil || c.Lease == nil {
		t.Errorf("at the end of its backoff = %+v, %v; want a lease", c, err)
	}
	// Budget: a third re-drive, then given up.
	b.clock.Advance(time.Minute)
	if c, err := s.Claim(ctx, redriveOf(listed, due)); err != nil || c.Lease == nil {
		t.Errorf("third re-drive = %+v, %v; want a lease", c, err)
	}
	b.clock.Advance(time.Hour)
	givenUp := get(t, s, "u", "k")
	if givenUp.Redrives != 3 {
		t.Fatalf("redrives %d, want 3", givenUp.Redrives)
	}
	if _, err := s.Claim(ctx, redriveOf(listed, due)); !errors.Is(err, idem.ErrNotDue) {
		t.Errorf("given up: %v, want ErrNotDue", err)
	}
	unchanged(t, s, givenUp, "given up")
	// A client still takes it over, uncounted in the re-drives.
	if c, err := s.Claim(ctx, params("u", "k", "fp")); err != nil || c.Lease == nil {
		t.Errorf("client's takeover of a given-up key = %+v, %v; want a lease", c, err)
	}

	// Answered: not due, whatever its expiry; never replaced.
	done := lease(t, s, params("u", "done", "fp"))
	listedDone := get(t, s, "u", "done")
	if err := begin(t, s, done, "done").Complete(ctx, response("ok")); err != nil {
		t.Fatal(err)
	}
	for _, wait := range []time.Duration{0, 48 * time.Hour} {
		b.clock.Advance(wait)
		if c, err := s.Claim(ctx, redriveOf(listedDone, idemdriver.AbandonedParams{})); !errors.Is(err, idem.ErrNotDue) {
			t.Errorf("answered, %v later: %+v, %v; want ErrNotDue", wait, c, err)
		}
	}
	var status *int
	if err := b.pool.QueryRow(ctx, `SELECT response_status FROM idempotency_keys WHERE key = 'done'`).Scan(&status); err != nil || status == nil {
		t.Errorf("expired answered record after a completer's claim: status %v, %v; want it kept", status, err)
	}

	// No row: not due, nothing inserted.
	gone := *listed
	gone.Key = "never"
	if _, err := s.Claim(ctx, redriveOf(&gone, idemdriver.AbandonedParams{})); !errors.Is(err, idem.ErrNotDue) {
		t.Errorf("no row: %v, want ErrNotDue", err)
	}
	if _, err := s.Get(ctx, "u", "never"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("no row: Get after the claim = %v, want ErrNotFound", err)
	}
}

// TestRedriveStaleListingWaitsForBackoff (finding 1): two completers list
// the same abandoned key at once; the first re-drives it and fails at once
// (Fail ends the lease). The second reaches the key in its stale list: its
// claim is not due, by the backoff its listing never saw, and the key is
// not re-driven again until the backoff passed.
func TestRedriveStaleListingWaitsForBackoff(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	due := idemdriver.AbandonedParams{Limit: 10, MaxRedrives: 5, Backoff: 30 * time.Second, MaxBackoff: 10 * time.Minute}

	p := params("u", "k", "fp")
	p.Lease = time.Second
	lease(t, s, p)
	b.clock.Advance(2 * time.Second)

	var lists [2][]idemdriver.Record
	for i := range lists {
		recs, err := s.Abandoned(ctx, due)
		if err != nil || len(recs) != 1 {
			t.Fatalf("completer %d: Abandoned = %v, %v; want k", i, keys(recs), err)
		}
		lists[i] = recs
	}

	// The first completer re-drives k; the request fails at once.
	c, err := s.Claim(ctx, redriveOf(&lists[0][0], due))
	if err != nil || c.Lease == nil {
		t.Fatalf("first completer's claim = %+v, %v; want a lease", c, err)
	}
	if err := s.Fail(ctx, c.Lease); err != nil {
		t.Fatal(err)
	}
	failed := get(t, s, "u", "k")

	// The second completer, from its stale list.
	if c, err := s.Claim(ctx, redriveOf(&lists[1][0], due)); !errors.Is(err, idem.ErrNotDue) {
		t.Fatalf("second completer's claim right after the first's re-drive failed = %+v, %v; want ErrNotDue", c, err)
	}
	unchanged(t, s, failed, "second completer's claim")
	if failed.Redrives != 1 {
		t.Errorf("redrives %d, want 1", failed.Redrives)
	}

	// Once the backoff passed, the stale listing still names the same
	// operation: it is re-driven, counted.
	b.clock.Advance(due.BackoffAfter(1))
	if c, err := s.Claim(ctx, redriveOf(&lists[1][0], due)); err != nil || c.Lease == nil || c.Lease.Attempt != 3 {
		t.Fatalf("second completer's claim after the backoff = %+v, %v; want attempt 3", c, err)
	}
	if rec := get(t, s, "u", "k"); rec.Redrives != 2 {
		t.Errorf("redrives %d, want 2", rec.Redrives)
	}
}

// TestRedriveConcurrentCompleters: completers that listed the same key
// claim it at once; exactly one takes it over, once counted, and the
// others are answered in flight or not due.
func TestRedriveConcurrentCompleters(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	due := idemdriver.AbandonedParams{Limit: 10, Backoff: time.Minute}
	p := params("u", "k", "fp")
	p.Lease = time.Second
	lease(t, s, p)
	b.clock.Advance(2 * time.Second)
	listed := get(t, s, "u", "k")

	const n = 8
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		leases int
	)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := s.Claim(ctx, redriveOf(listed, due))
			switch {
			case err == nil && c.Lease != nil:
				mu.Lock()
				leases++
				mu.Unlock()
			case errors.Is(err, idem.ErrInFlight), errors.Is(err, idem.ErrNotDue):
			default:
				t.Errorf("concurrent completer's claim = %+v, %v", c, err)
			}
		}()
	}
	wg.Wait()
	if rec := get(t, s, "u", "k"); leases != 1 || rec.Redrives != 1 || rec.Attempts != 2 {
		t.Errorf("%d leases, redrives %d, attempts %d; want 1, 1, 2", leases, rec.Redrives, rec.Attempts)
	}
}

// TestRedriveStaleListingNeverTakesAnotherOperation (finding 2): a
// completer listed operation A on a key; before it claims, A ended (its
// record released, or completed, expired and replaced) and a client
// started operation B on the same key, whose lease ran out too. The stale
// listing is not due: B is neither taken over nor counted.
func TestRedriveStaleListingNeverTakesAnotherOperation(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()

	for _, end := range []string{"released", "replaced"} {
		t.Run(end, func(t *testing.T) {
			key := "k-" + end
			p := params("u", key, "fp")
			p.Lease, p.TTL = time.Second, time.Hour
			a := lease(t, s, p)
			b.clock.Advance(2 * time.Second)
			recs, err := s.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10})
			if err != nil {
				t.Fatal(err)
			}
			var listed *idemdriver.Record
			for i := range recs {
				if recs[i].Key == key {
					listed = &recs[i]
				}
			}
			if listed == nil {
				t.Fatalf("Abandoned = %v, want %s", keys(recs), key)
			}

			// A ends; B starts on the same key, and its lease runs out.
			switch end {
			case "released":
				if err := s.Release(ctx, a); err != nil {
					t.Fatal(err)
				}
			case "replaced":
				a = lease(t, s, p) // a client's takeover of A
				if err := begin(t, s, a, key).Complete(ctx, response("A")); err != nil {
					t.Fatal(err)
				}
				b.clock.Advance(2 * time.Hour)
			}
			opB := lease(t, s, p)
			if opB.CreatedAt.Equal(listed.CreatedAt) {
				t.Fatalf("B's CreatedAt %v is A's", opB.CreatedAt)
			}
			b.clock.Advance(2 * time.Second)
			recB := get(t, s, "u", key)

			if c, err := s.Claim(ctx, redriveOf(listed, idemdriver.AbandonedParams{})); !errors.Is(err, idem.ErrNotDue) {
				t.Errorf("stale listing of A on B = %+v, %v; want ErrNotDue", c, err)
			}
			unchanged(t, s, recB, "stale listing of A")
			if recB.Redrives != 0 || recB.Attempts != 1 {
				t.Errorf("B: redrives %d attempts %d, want 0, 1", recB.Redrives, recB.Attempts)
			}
			// B's own listing is due.
			if c, err := s.Claim(ctx, redriveOf(recB, idemdriver.AbandonedParams{})); err != nil || c.Lease == nil || !c.Lease.CreatedAt.Equal(recB.CreatedAt) {
				t.Errorf("B's listing = %+v, %v; want a lease on B", c, err)
			}
		})
	}
}

// TestRedriveBackoffByDatabaseClock: a completer's claim decides the
// backoff by the database's clock, read with the row, not the process's:
// on an instance whose clock runs 25 hours ahead, a key whose re-drive
// just failed is still not due.
func TestRedriveBackoffByDatabaseClock(t *testing.T) {
	t.Parallel()
	pool := skewedPool(t, -25*time.Hour)
	ctx := context.Background()
	s := pgstore.New(pool, pgstore.Options{})
	due := idemdriver.AbandonedParams{Backoff: time.Hour}

	p := params("u", "k", "fp")
	l := lease(t, s, p)
	if err := s.Fail(ctx, l); err != nil {
		t.Fatal(err)
	}
	listed := get(t, s, "u", "k")
	c, err := s.Claim(ctx, redriveOf(listed, due))
	if err != nil || c.Lease == nil {
		t.Fatalf("first re-drive = %+v, %v; want a lease", c, err)
	}
	if err := s.Fail(ctx, c.Lease); err != nil {
		t.Fatal(err)
	}
	failed := get(t, s, "u", "k")
	// By this process's clock the backoff passed a day ago.
	if !due.Due(failed, time.Now()) {
		t.Fatalf("Due by the process's clock = false; the test needs it true")
	}
	if c, err := s.Claim(ctx, redriveOf(listed, due)); !errors.Is(err, idem.ErrNotDue) {
		t.Errorf("re-drive in its backoff by the database's clock = %+v, %v; want ErrNotDue", c, err)
	}
	unchanged(t, s, failed, "re-drive in its backoff")
}

// TestAbandonedDueAtSubMicrosecondBackoff (fifth review): Abandoned
// decides exactly as idemdriver.AbandonedParams.Due, to the nanosecond of the
// parameters: with Backoff 1.5µs a record re-driven twice is due 3µs after
// its lease (Due, memstore and sqlitestore), not 4µs (the backoff rounded
// up to 2µs before it was doubled).
func TestAbandonedDueAtSubMicrosecondBackoff(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	p := params("u", "k", "f")
	p.Lease = time.Second
	lease(t, s, p)
	for range 2 { // two completers' takeovers: redrives 2
		b.clock.Advance(2 * time.Second)
		lease(t, s, redriveOf(get(t, s, "u", "k"), idemdriver.AbandonedParams{}))
	}
	rec := get(t, s, "u", "k")
	if rec.Redrives != 2 {
		t.Fatalf("redrives %d, want 2", rec.Redrives)
	}
	ap := idemdriver.AbandonedParams{Limit: 10, Backoff: 1500 * time.Nanosecond}
	b.clock.Advance(rec.LeaseUntil.Sub(b.clock.Now()) + 2*time.Microsecond)
	for range 3 { // 2µs: waits; 3µs: due (exactly); 4µs: due
		got, err := s.Abandoned(ctx, ap)
		if err != nil {
			t.Fatal(err)
		}
		if want := ap.Due(rec, b.clock.Now()); want != (len(got) == 1) {
			t.Errorf("%v after the lease ended, Backoff 1.5µs, redrives 2: Due says %v, pgstore lists %d records (BackoffAfter %v)",
				b.clock.Now().Sub(rec.LeaseUntil), want, len(got), ap.BackoffAfter(2))
		}
		b.clock.Advance(time.Microsecond)
	}
}

// TestMigrationDoesNotStallClaimsBehindAReader (fifth review): 0003 runs
// ALTER TABLE … ADD COLUMN and DROP INDEX in the migration's transaction,
// both ACCESS EXCLUSIVE on idempotency_keys, even when the new index was
// built CONCURRENTLY beforehand as the file advises. While the ALTER waits
// for a long reader (an audit, a pg_dump), every other statement on the
// table queues behind it: without a lock_timeout, every Claim of every
// running instance stalled until the reader ended. With it, the claim
// waits at most the migration's 5 seconds, the migration fails with an
// error that says why and applies nothing, and a later start succeeds.
func TestMigrationDoesNotStallClaimsBehindAReader(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := context.Background()
	old := fstest.MapFS{}
	for _, name := range []string{"0001_idempotency_keys.sql", "0002_completed_expiry_index.sql"} {
		b, err := os.ReadFile("migrations/" + name)
		if err != nil {
			t.Fatal(err)
		}
		old[name] = &fstest.MapFile{Data: b}
	}
	if err := pgstore.ApplyMigrations(ctx, pool, pgstore.Component, old); err != nil {
		t.Fatal(err)
	}
	// As 0003 advises on a large table: the index built beforehand.
	if _, err := pool.Exec(ctx, `CREATE INDEX CONCURRENTLY idempotency_keys_abandoned_order_idx
		ON idempotency_keys (lease_until, created_at, user_id, key) WHERE response_status IS NULL`); err != nil {
		t.Fatal(err)
	}
	s := pgstore.New(pool, pgstore.Options{})
	// The running instances are of the version that 0003 upgrades from:
	// their claims are the INSERT … ON CONFLICT DO NOTHING of that schema
	// (today's claim also reads columns that 0003 and 0004 add, and a new
	// instance migrates before it claims).
	oldClaim := func(ctx context.Context, key string) error {
		tag, err := pool.Exec(ctx, `
INSERT INTO idempotency_keys (user_id, key, fingerprint, method, path, owner, lease_until, attempts, created_at, expires_at)
VALUES ('u', $1, 'f', 'POST', '/v1/orders', 'old-instance', statement_timestamp() + interval '30 seconds', 1,
	statement_timestamp(), statement_timestamp() + interval '1 day')
ON CONFLICT (user_id, key) DO NOTHING`, key)
		if err == nil && tag.RowsAffected() != 1 {
			err = fmt.Errorf("the key %s exists", key)
		}
		return err
	}
	if err := oldClaim(ctx, "before"); err != nil {
		t.Fatal(err)
	}

	// A long reader: an audit, a report, a dump.
	reader, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback(ctx)
	if _, err := reader.Exec(ctx, `SELECT count(*) FROM idempotency_keys`); err != nil {
		t.Fatal(err)
	}

	// A new instance starts and migrates.
	migrated := make(chan error, 1)
	go func() { migrated <- pgstore.Migrate(ctx, pool) }()
	testwait.Until(t, 5*time.Second, "the migration to wait for its lock", func() bool {
		var waiting int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%ADD COLUMN redrives%'`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		return waiting > 0
	})

	// A running instance serves a request meanwhile: it waits at most
	// for the migration's lock_timeout, not for the reader.
	cctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	start := time.Now()
	err = oldClaim(cctx, "during")
	took := time.Since(start)
	if err != nil {
		t.Errorf("a claim while 0003 waits for a reader: %v after %v; want the key inserted", err, took.Round(time.Millisecond))
	}
	if took > 7*time.Second {
		t.Errorf("a Claim while 0003 waits for a reader took %v; want at most the migration's 5s lock_timeout", took.Round(time.Millisecond))
	}

	// The migration gave up, clearly, and applied nothing.
	merr := <-migrated
	var pe *pgconn.PgError
	if merr == nil || !errors.As(merr, &pe) || pe.Code != "55P03" || !strings.Contains(merr.Error(), "a long transaction holds the table") ||
		!strings.Contains(merr.Error(), "may be retried") {
		t.Errorf("Migrate behind a reader: %v; want lock_not_available (55P03) explained", merr)
	}
	var applied int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM schema_migrations WHERE component = $1 AND version = 3`, pgstore.Component).Scan(&applied); err != nil || applied != 0 {
		t.Errorf("0003 recorded %d times (%v) after its failure; want 0", applied, err)
	}

	// The reader ends; the next start migrates.
	reader.Rollback(ctx)
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate once the reader ended: %v", err)
	}
	if rec := get(t, s, "u", "during"); rec.Redrives != 0 {
		t.Errorf("after the migration: redrives %d, want 0", rec.Redrives)
	}
}
