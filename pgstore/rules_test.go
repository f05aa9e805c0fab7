package pgstore_test

// Tests of issue 8's store rules on PostgreSQL: the database's clock
// decides (point 8), a Claim resent with its owner gets its lease (point
// 5), and expiry never takes a key from an attempt that may have paid
// (point 2). Each fails on the store as it was before (see the comments).

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// skewedPool returns a migrated pool (see migratedPool) whose sessions see
// the database's clock moved by skew: functions in the test's schema
// shadow pg_catalog's statement_timestamp(), now(), transaction_timestamp()
// and clock_timestamp(), and the sessions' search_path names pg_catalog
// after that schema (pg_catalog is searched first only when the path does
// not name it). To the store, whose SQL calls these functions, the skewed
// clock is the database's clock.
func skewedPool(t *testing.T, skew time.Duration) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	plain := migratedPool(t)
	var schema string
	if err := plain.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
		t.Fatal(err)
	}
	for fn, volatility := range map[string]string{
		"statement_timestamp":   "STABLE",
		"now":                   "STABLE",
		"transaction_timestamp": "STABLE",
		"clock_timestamp":       "VOLATILE",
	} {
		if _, err := plain.Exec(ctx, fmt.Sprintf(`
CREATE FUNCTION %[1]s.%[2]s() RETURNS timestamptz LANGUAGE sql %[3]s
AS $$ SELECT pg_catalog.%[2]s() + interval '%[4]d microseconds' $$`,
			schema, fn, volatility, skew.Microseconds())); err != nil {
			t.Fatalf("creating %s.%s: %v", schema, fn, err)
		}
	}
	cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema + ", pg_catalog"
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var got time.Duration
	if err := pool.QueryRow(ctx, `SELECT statement_timestamp() - pg_catalog.statement_timestamp()`).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if got != skew {
		t.Fatalf("skewed session's clock is off by %v, want %v", got, skew)
	}
	return pool
}

// within reports whether got lies in [from-slack, to+slack].
func within(got, from, to time.Time) bool {
	const slack = 5 * time.Second
	return !got.Before(from.Add(-slack)) && !got.After(to.Add(slack))
}

// TestDatabaseClockDecides (issue 8, point 8): leases, expiry and cleaning
// follow the database's clock, not the process's. The database's clock is
// set 25 hours behind this process's (see skewedPool), so this process is
// an instance whose clock runs 25 hours ahead of the database and of an
// instance whose clock agrees with it ("synced", modelled with
// Options.Now). With a 24h TTL and 1-minute leases, the instance that runs
// ahead must still replay the synced instance's completed key, answer 409
// on its running attempts, and neither list them as abandoned nor delete
// them.
//
// On the store before issue 8, which passed Options.Now (default time.Now)
// to every statement, this fails at every step: the records it creates
// carry the process's times, not the database's; ExpiresIn is zero; the
// completed key is past its expiry by the process's clock, so Claim
// replaces it (a second operation, a second charge) and another body gets a
// lease instead of 422; the running key's lease has ended by the process's
// clock, so Claim takes it over and Abandoned lists it (a second, concurrent
// execution); and DeleteExpired deletes the completed key and the running
// key whose 1h TTL has passed by the process's clock, so the synced
// attempt's Complete is fenced and its payment is left without its order.
func TestDatabaseClockDecides(t *testing.T) {
	t.Parallel()
	const skew = -25 * time.Hour
	pool := skewedPool(t, skew)
	ctx := context.Background()
	dbNow := func() time.Time { return time.Now().Add(skew) }
	ahead := pgstore.New(pool, pgstore.Options{})            // the default: production's store
	synced := pgstore.New(pool, pgstore.Options{Now: dbNow}) // an instance whose clock agrees with the database

	t.Run("TimesAreTheDatabases", func(t *testing.T) {
		p := params("u1", "k-times", "fp1")
		p.TTL = 24 * time.Hour
		from := dbNow()
		c, err := ahead.Claim(ctx, p)
		to := dbNow()
		if err != nil || c.Lease == nil {
			t.Fatalf("Claim = %+v, %v; want a lease", c, err)
		}
		l := c.Lease
		if !within(l.CreatedAt, from, to) || !l.Until.Equal(l.CreatedAt.Add(p.Lease)) {
			t.Errorf("lease created %v until %v, want the database's time (%v … %v) and a lease of %v",
				l.CreatedAt, l.Until, from, to, p.Lease)
		}
		if c.ExpiresIn != p.TTL {
			t.Errorf("ExpiresIn = %v, want %v", c.ExpiresIn, p.TTL)
		}
		rec, err := ahead.Get(ctx, p.User, p.Key)
		if err != nil || !rec.ExpiresAt.Equal(l.CreatedAt.Add(p.TTL)) {
			t.Fatalf("Get = %+v, %v; want expiry %v", rec, err, l.CreatedAt.Add(p.TTL))
		}

		from = dbNow()
		if err := ahead.Fail(ctx, l); err != nil {
			t.Fatalf("Fail: %v", err)
		}
		to = dbNow()
		if rec, err := ahead.Get(ctx, p.User, p.Key); err != nil || !within(rec.LeaseUntil, from, to) {
			t.Errorf("after Fail: Get = %+v, %v; want the lease ended at the database's time (%v … %v)", rec, err, from, to)
		}
		from = dbNow()
		c, err = ahead.Claim(ctx, p)
		to = dbNow()
		if err != nil || c.Lease == nil || c.Lease.Attempt != 2 || !within(c.Lease.Until, from.Add(p.Lease), to.Add(p.Lease)) {
			t.Fatalf("takeover = %+v, %v; want attempt 2 leased until the database's time + %v", c, err, p.Lease)
		}
		// The takeover's time, in [from, to], plus ExpiresIn is the expiry.
		if !within(rec.ExpiresAt, from.Add(c.ExpiresIn), to.Add(c.ExpiresIn)) {
			t.Errorf("takeover: ExpiresIn = %v, want about %v", c.ExpiresIn, rec.ExpiresAt.Sub(to))
		}
		from = dbNow()
		if err := begin(t, ahead, c.Lease, "times").Complete(ctx, response("done")); err != nil {
			t.Fatalf("Complete: %v", err)
		}
		to = dbNow()
		if rec, err := ahead.Get(ctx, p.User, p.Key); err != nil || !within(rec.CompletedAt, from, to) ||
			!rec.ExpiresAt.Equal(l.CreatedAt.Add(p.TTL)) {
			t.Errorf("after Complete: Get = %+v, %v; want completed at the database's time (%v … %v), expiry unchanged", rec, err, from, to)
		}
	})

	t.Run("CompletedKeyLivesItsTTL", func(t *testing.T) {
		p := params("u1", "k-paid", "fp1")
		p.TTL = 24 * time.Hour
		if err := begin(t, synced, lease(t, synced, p), "paid").Complete(ctx, response("paid")); err != nil {
			t.Fatalf("Complete: %v", err)
		}
		// By this process's clock the key expired an hour ago; by the
		// database's it has a day to live.
		c, err := ahead.Claim(ctx, p)
		if err != nil || c.Response == nil || string(c.Response.Body) != "paid" {
			t.Errorf("retry on the instance that runs ahead = %+v, %v; want the replay", c, err)
		}
		if err == nil && c.Response != nil && (c.ExpiresIn <= p.TTL-time.Minute || c.ExpiresIn > p.TTL) {
			t.Errorf("replay: ExpiresIn = %v, want just under %v", c.ExpiresIn, p.TTL)
		}
		if _, err := ahead.Claim(ctx, params("u1", "k-paid", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
			t.Errorf("another body on the instance that runs ahead: got %v, want ErrFingerprintMismatch", err)
		}
		if n, err := ahead.DeleteExpired(ctx, 100); err != nil || n != 0 {
			t.Errorf("DeleteExpired on the instance that runs ahead = %d, %v; want 0", n, err)
		}
		if _, err := ahead.Get(ctx, p.User, p.Key); err != nil {
			t.Errorf("Get on the instance that runs ahead: %v", err)
		}
	})

	t.Run("LeaseLiveElsewhere", func(t *testing.T) {
		long := params("u1", "k-running", "fp1")
		long.TTL, long.Lease = 48*time.Hour, time.Minute
		short := params("u1", "k-running-short-ttl", "fp1")
		short.TTL, short.Lease = time.Hour, time.Minute
		running := map[string]*idemdriver.Lease{}
		for _, p := range []idemdriver.ClaimParams{long, short} {
			running[p.Key] = lease(t, synced, p)
			if _, err := ahead.Claim(ctx, p); !errors.Is(err, idem.ErrInFlight) {
				t.Errorf("%s: retry on the instance that runs ahead: got %v, want ErrInFlight", p.Key, err)
			}
		}
		if recs, err := ahead.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 100}); err != nil || len(recs) != 0 {
			t.Errorf("Abandoned on the instance that runs ahead = %s, %v; want none", keys(recs), err)
		}
		if n, err := ahead.Clean(ctx, pgstore.CleanOptions{}); err != nil || n != 0 {
			t.Errorf("Clean on the instance that runs ahead = %d, %v; want 0", n, err)
		}
		for key, l := range running {
			if err := begin(t, synced, l, key).Complete(ctx, response(key)); err != nil {
				t.Errorf("%s: the running attempt's Complete: %v", key, err)
			}
			if got := effects(t, &testBundle{pool: pool}, key); got != 1 {
				t.Errorf("%s: effects = %d, want 1", key, got)
			}
		}
	})
}

// keys lists the records' keys.
func keys(recs []idemdriver.Record) []string {
	out := make([]string, len(recs))
	for i, r := range recs {
		out[i] = r.Key
	}
	return out
}

// TestClaimResendSameOwner (issue 8, point 5): a Claim sent again with the
// same Owner, as after an answer lost with the connection, returns the
// lease its first call took, as stored, on each path that takes a key (a
// new key, a takeover, the replacement of an expired answer), and never
// ErrInFlight; the attempt is counted once. Two copies sent at once both
// get it. The store before issue 8 ignored ClaimParams.Owner (a fresh
// token per call), so every resend was answered ErrInFlight.
func TestClaimResendSameOwner(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	resend := func(t *testing.T, p idemdriver.ClaimParams, first *idemdriver.Lease, attempts int) {
		t.Helper()
		if first.Owner != p.Owner {
			t.Errorf("lease owner = %q, want the caller's %q", first.Owner, p.Owner)
		}
		for i := range 2 {
			c, err := s.Claim(ctx, p)
			if err != nil || c.Lease == nil || *c.Lease != *first {
				t.Fatalf("resend %d = %+v, %v; want the same lease %+v", i, c, err, first)
			}
		}
		if rec, err := s.Get(ctx, p.User, p.Key); err != nil || rec.Owner != p.Owner || rec.Attempts != attempts {
			t.Errorf("Get = %+v, %v; want owner %q and %d attempts", rec, err, p.Owner, attempts)
		}
	}
	p := params("u1", "k-resend", "fp1")
	p.TTL, p.Lease = time.Hour, time.Minute

	p.Owner = idemdriver.NewOwner()
	first := lease(t, s, p)
	t.Run("Insert", func(t *testing.T) { resend(t, p, first, 1) })

	b.clock.Advance(p.Lease) // the first attempt's lease ran out
	p.Owner = idemdriver.NewOwner()
	taken := lease(t, s, p)
	if taken.Attempt != 2 || !taken.CreatedAt.Equal(first.CreatedAt) {
		t.Fatalf("takeover = %+v, want attempt 2 of the same operation", taken)
	}
	t.Run("Takeover", func(t *testing.T) { resend(t, p, taken, 2) })
	if err := begin(t, s, taken, "resend").Complete(ctx, response("done")); err != nil {
		t.Fatalf("Complete: %v", err)
	}

	b.clock.Advance(p.TTL) // the answer expired: the key starts over
	p.Owner = idemdriver.NewOwner()
	fresh := lease(t, s, p)
	if fresh.Attempt != 1 || fresh.CreatedAt.Equal(first.CreatedAt) {
		t.Fatalf("claim after expiry = %+v, want a new operation", fresh)
	}
	t.Run("Replace", func(t *testing.T) { resend(t, p, fresh, 1) })

	t.Run("Concurrent", func(t *testing.T) {
		for i := range 20 {
			p := params("u1", fmt.Sprintf("k-twice-%d", i), "fp1")
			p.Owner = idemdriver.NewOwner()
			var leases [2]*idemdriver.Lease
			var wg sync.WaitGroup
			for j := range leases {
				wg.Add(1)
				go func() {
					defer wg.Done()
					c, err := s.Claim(ctx, p)
					if err != nil || c.Lease == nil {
						t.Errorf("%s, copy %d: Claim = %+v, %v; want the lease", p.Key, j, c, err)
						return
					}
					leases[j] = c.Lease
				}()
			}
			wg.Wait()
			if leases[0] != nil && leases[1] != nil && *leases[0] != *leases[1] {
				t.Errorf("%s: the two copies got %+v and %+v, want one lease", p.Key, leases[0], leases[1])
			}
		}
	})
}

// TestExpiredUnansweredRecord (issue 8, point 2): a record whose TTL ran out
// while its attempt still runs is neither replaced nor deleted: a retry is
// in flight, another body is a mismatch, Get still finds it; once its lease
// runs out the completer lists it and a takeover continues the same
// operation (same CreatedAt); the late completion keeps the answer a TTL
// from then, so the next retry replays it. The store before issue 8
// replaced the record (a new operation, a second payment) and Get, Abandoned
// and DeleteExpired treated it as gone.
func TestExpiredUnansweredRecord(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	p := params("u1", "k-slow", "fp1")
	p.TTL, p.Lease = time.Second, time.Minute
	first := lease(t, s, p)

	b.clock.Advance(2 * p.TTL) // expired; the lease still live
	retry := p
	retry.Owner = idemdriver.NewOwner()
	_, err := s.Claim(ctx, retry)
	var ife *idem.InFlightError
	if !errors.As(err, &ife) || !ife.LeaseUntil.Equal(first.Until) {
		t.Errorf("retry after expiry, lease live: got %v, want *InFlightError until %v", err, first.Until)
	}
	if _, err := s.Claim(ctx, params("u1", p.Key, "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Errorf("other body after expiry: got %v, want ErrFingerprintMismatch", err)
	}
	if n, err := s.DeleteExpired(ctx, 10); err != nil || n != 0 {
		t.Errorf("DeleteExpired, lease live = %d, %v; want 0", n, err)
	}
	if rec, err := s.Get(ctx, p.User, p.Key); err != nil || rec.Owner != first.Owner {
		t.Errorf("Get after expiry = %+v, %v; want the running attempt's record", rec, err)
	}
	if recs, err := s.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10}); err != nil || len(recs) != 0 {
		t.Errorf("Abandoned, lease live = %s, %v; want none", keys(recs), err)
	}

	b.clock.Advance(p.Lease) // the attempt is gone: its lease ran out
	if recs, err := s.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10}); err != nil || len(recs) != 1 || recs[0].Key != p.Key {
		t.Errorf("Abandoned once the lease ran out = %s, %v; want %s", keys(recs), err, p.Key)
	}
	if n, err := s.DeleteExpired(ctx, 10); err != nil || n != 0 {
		t.Errorf("DeleteExpired, lease run out = %d, %v; want 0", n, err)
	}
	c, err := s.Claim(ctx, retry)
	if err != nil || c.Lease == nil {
		t.Fatalf("takeover = %+v, %v; want a lease", c, err)
	}
	second := c.Lease
	if second.Attempt != 2 || !second.CreatedAt.Equal(first.CreatedAt) || second.Owner != retry.Owner || c.ExpiresIn != 0 {
		t.Errorf("takeover = %+v (expires in %v), want attempt 2 of the same operation (created %v), already expired",
			second, c.ExpiresIn, first.CreatedAt)
	}
	if err := begin(t, s, first, "slow-first").Complete(ctx, response("first")); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("the first attempt's Complete after the takeover: got %v, want ErrFenced", err)
	}

	b.clock.Advance(time.Second)
	completed := b.clock.Now()
	if err := begin(t, s, second, "slow").Complete(ctx, response("done")); err != nil {
		t.Fatalf("the takeover's Complete: %v", err)
	}
	rec, err := s.Get(ctx, p.User, p.Key)
	if err != nil || !rec.CompletedAt.Equal(completed) || !rec.ExpiresAt.Equal(completed.Add(p.TTL)) ||
		!rec.CreatedAt.Equal(first.CreatedAt) {
		t.Fatalf("Get after the late completion = %+v, %v; want completed %v, expiring a TTL later", rec, err, completed)
	}
	b.clock.Advance(p.TTL - time.Microsecond)
	c, err = s.Claim(ctx, retry)
	if err != nil || c.Response == nil || string(c.Response.Body) != "done" || c.ExpiresIn != time.Microsecond {
		t.Errorf("retry after the late completion = %+v, %v; want the replay, expiring in 1µs", c, err)
	}
	if got, want := effects(t, b, "slow")+effects(t, b, "slow-first"), 1; got != want {
		t.Errorf("effects = %d, want %d", got, want)
	}

	b.clock.Advance(time.Microsecond) // the answer has lived its TTL
	if n, err := s.DeleteExpired(ctx, 10); err != nil || n != 1 {
		t.Errorf("DeleteExpired once the answer expired = %d, %v; want 1", n, err)
	}
	if _, err := s.Get(ctx, p.User, p.Key); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get after cleaning: got %v, want ErrNotFound", err)
	}
}
