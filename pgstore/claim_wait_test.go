package pgstore_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/storetest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TestClaimAfterWaitingOnTheKeysRow has a claim wait, in idem_claim's
// INSERT, on a transaction that writes the key's row, and checks what it
// decides once that transaction ends, on pools whose sessions default to
// each isolation level: an insert rolled back leaves the key free (a
// lease); an insert committed is another claim's lease (409, never a
// second lease); a delete committed (the cleaner) leaves the key free;
// a delete rolled back leaves the completed record (its replay).
func TestClaimAfterWaitingOnTheKeysRow(t *testing.T) {
	const insert = `
INSERT INTO idempotency_keys (user_id, key, fingerprint, method, path, owner, lease_until, attempts, created_at, expires_at)
VALUES ('u', 'waited', 'fp', 'POST', '/v1/orders', 'other-owner', $1::timestamptz + interval '30 seconds', 1, $1, $1::timestamptz + interval '1 day')`
	const completed = `
INSERT INTO idempotency_keys (user_id, key, fingerprint, method, path, owner, lease_until, attempts, created_at, expires_at, response_status, response_body)
VALUES ('u', 'waited', 'fp', 'POST', '/v1/orders', 'done-owner', $1::timestamptz - interval '1 hour', 1, $1::timestamptz - interval '2 hours', $1::timestamptz + interval '1 day', 201, 'done')`
	cases := []struct {
		name   string
		setup  string // committed before
		other  string // the waited-on transaction's statement
		commit bool
		want   string // "lease", "inflight", "replay"
	}{
		{name: "insert_rolled_back", other: insert, commit: false, want: "lease"},
		{name: "insert_committed", other: insert, commit: true, want: "inflight"},
		{name: "delete_committed", setup: completed, other: `DELETE FROM idempotency_keys WHERE key = 'waited'`, commit: true, want: "lease"},
		{name: "delete_rolled_back", setup: completed, other: `DELETE FROM idempotency_keys WHERE key = 'waited'`, commit: false, want: "replay"},
	}
	for _, iso := range []string{"read committed", "repeatable read", "serializable"} {
		for _, tc := range cases {
			t.Run(iso+"/"+tc.name, func(t *testing.T) {
				ctx := context.Background()
				pool := migratedPool(t, func(c *pgxpool.Config) {
					c.ConnConfig.RuntimeParams["default_transaction_isolation"] = iso
				})
				clock := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
				s := pgstore.New(pool, pgstore.Options{Now: clock.Now})
				if tc.setup != "" {
					if _, err := pool.Exec(ctx, tc.setup, clock.Now()); err != nil {
						t.Fatal(err)
					}
				}
				other, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
				if err != nil {
					t.Fatal(err)
				}
				defer other.Rollback(ctx)
				var args []any
				if tc.other == insert {
					args = append(args, clock.Now())
				}
				if _, err := other.Exec(ctx, tc.other, args...); err != nil {
					t.Fatal(err)
				}
				claimed := claimWaiting(t, pool, s, params("u", "waited", "fp"), "the claim to wait on the other transaction's row",
					`query LIKE '%idem_claim(%'`)
				if tc.commit {
					err = other.Commit(ctx)
				} else {
					err = other.Rollback(ctx)
				}
				if err != nil {
					t.Fatal(err)
				}
				c, cer := claimed()
				var inflight *idem.InFlightError
				switch tc.want {
				case "lease":
					if cer != nil || c.Lease == nil || c.Lease.Attempt != 1 {
						t.Fatalf("Claim = %+v, %v; want a new lease", c, cer)
					}
				case "inflight":
					if !errors.As(cer, &inflight) || c.Lease != nil {
						t.Fatalf("Claim = %+v, %v; want the other claim's lease (409)", c, cer)
					}
				case "replay":
					if cer != nil || c.Response == nil || string(c.Response.Body) != "done" {
						t.Fatalf("Claim = %+v, %v; want the completed record's replay", c, cer)
					}
				}
				if !pgstore.ClaimFuncInUse(s) {
					t.Errorf("the claim fell back to the insert-or-read statement")
				}
			})
		}
	}
}

// TestClaimWhenTheRowChangesBetweenInsertAndSelect stops idem_claim
// between its INSERT, which found the key's row, and its SELECT (a copy
// of the function that waits there on an advisory lock the test holds),
// and meanwhile deletes the row, or deletes it and lets another claim
// take the key: the claim then decides on what the SELECT finds, or, when
// it finds nothing, claims the free key; never a lease beside another one.
func TestClaimWhenTheRowChangesBetweenInsertAndSelect(t *testing.T) {
	create, err := os.ReadFile("migrations/0006_claim_function.sql")
	if err != nil {
		t.Fatal(err)
	}
	const between = "    END IF;\n    RETURN QUERY\n    SELECT false"
	if !strings.Contains(string(create), between) {
		t.Fatal("the migration's function changed: no SELECT after the INSERT's IF FOUND")
	}
	paused := strings.Replace(strings.Replace(string(create), "CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1), between,
		"    END IF;\n    PERFORM pg_advisory_lock(4242); PERFORM pg_advisory_unlock(4242);\n    RETURN QUERY\n    SELECT false", 1)
	cases := []struct {
		name  string
		other string // a claim of the key after the delete: its fingerprint
		want  string
	}{
		{name: "deleted", want: "lease"},
		{name: "deleted_then_claimed", other: "fp", want: "inflight"},
		{name: "deleted_then_claimed_with_another_body", other: "fp-other", want: "mismatch"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, b := setup(t)
			ctx := context.Background()
			if _, err := b.pool.Exec(ctx, paused); err != nil {
				t.Fatal(err)
			}
			p := params("u", "between", "fp")
			first := lease(t, s, p)
			if err := begin(t, s, first, "first").Complete(ctx, response("first")); err != nil {
				t.Fatal(err)
			}
			hold, err := b.pool.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer hold.Release()
			if _, err := hold.Exec(ctx, `SELECT pg_advisory_lock(4242)`); err != nil {
				t.Fatal(err)
			}
			claimed := claimWaiting(t, b.pool, s, p, "the claim to wait between its INSERT and its SELECT",
				`wait_event = 'advisory' AND query LIKE '%idem_claim(%'`)
			if _, err := b.pool.Exec(ctx, `DELETE FROM idempotency_keys WHERE key = 'between'`); err != nil {
				t.Fatal(err)
			}
			var other *idemdriver.Lease
			if tc.other != "" {
				// Not through the paused function: the statement.
				o := pgstore.New(b.pool, pgstore.Options{Now: b.clock.Now})
				if _, err := b.pool.Exec(ctx, `ALTER FUNCTION idem_claim RENAME TO idem_claim_paused`); err != nil {
					t.Fatal(err)
				}
				other = lease(t, o, params("u", "between", tc.other))
				if _, err := b.pool.Exec(ctx, `ALTER FUNCTION idem_claim_paused RENAME TO idem_claim`); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := hold.Exec(ctx, `SELECT pg_advisory_unlock(4242)`); err != nil {
				t.Fatal(err)
			}
			c, cer := claimed()
			var inflight *idem.InFlightError
			switch tc.want {
			case "lease":
				if cer != nil || c.Lease == nil || c.Lease.Attempt != 1 || c.Lease.Owner == first.Owner {
					t.Fatalf("Claim = %+v, %v; want a new lease on the free key", c, cer)
				}
			case "inflight":
				if !errors.As(cer, &inflight) || c.Lease != nil {
					t.Fatalf("Claim = %+v, %v; want 409: the other claim (%s) holds the key", c, cer, other.Owner)
				}
			case "mismatch":
				if !errors.Is(cer, idem.ErrFingerprintMismatch) || c.Lease != nil {
					t.Fatalf("Claim = %+v, %v; want ErrFingerprintMismatch", c, cer)
				}
			}
		})
	}
}

// claimWaiting starts s.Claim(ctx, p) in a goroutine and returns once
// pg_stat_activity shows a query waiting on a lock that matches cond (a
// condition on its columns, ANDed); what names the wait in the failure.
// The function it returns waits for the claim's answer.
func claimWaiting(t *testing.T, pool *pgxpool.Pool, s *pgstore.Store, p idemdriver.ClaimParams, what, cond string) func() (idemdriver.Claim, error) {
	t.Helper()
	type answer struct {
		c   idemdriver.Claim
		err error
	}
	done := make(chan answer, 1)
	go func() {
		c, err := s.Claim(context.Background(), p)
		done <- answer{c, err}
	}()
	testwait.Until(t, 10*time.Second, what, func() bool {
		var waiting int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND `+cond).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		return waiting > 0
	})
	return func() (idemdriver.Claim, error) {
		a := <-done
		return a.c, a.err
	}
}
