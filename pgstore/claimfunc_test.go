package pgstore_test

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
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// claimParams is a claim of key by user "u" with a fixed fingerprint.
func claimParams(key string) idemdriver.ClaimParams {
	return idemdriver.ClaimParams{
		User: "u", Key: key, Fingerprint: "fp", Method: "POST", Path: "/v1/orders",
		Header: map[string][]string{"Content-Type": {"application/json"}},
		Body:   []byte(`{"amount":1}`), Lease: time.Minute, TTL: time.Hour,
	}
}

// TestClaimFunctionUsedInEveryExecMode checks that claims call idem_claim
// in each of pgx's modes and on a SQL_ASCII database: a call whose
// arguments PostgreSQL could not match to the function's parameters
// (42883) would fall back to the insert-or-read statement for the life
// of the store, silently, and the conformance suite would still pass.
func TestClaimFunctionUsedInEveryExecMode(t *testing.T) {
	ctx := context.Background()
	check := func(t *testing.T, pool *pgxpool.Pool) {
		now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
		for _, clock := range []func() time.Time{nil, func() time.Time { return now }} {
			s := pgstore.New(pool, pgstore.Options{Now: clock})
			key := fmt.Sprintf("k-%v", clock == nil)
			c, err := s.Claim(ctx, claimParams(key))
			if err != nil || c.Lease == nil {
				t.Fatalf("first claim: %+v, %v; want a lease", c, err)
			}
			var inflight *idem.InFlightError
			if _, err := s.Claim(ctx, claimParams(key)); !errors.As(err, &inflight) {
				t.Fatalf("second claim: %v; want in flight", err)
			}
			if !pgstore.ClaimFuncInUse(s) {
				t.Errorf("test clock set %v: claims fell back to the insert-or-read statement", clock != nil)
			}
		}
	}
	for _, m := range execModes {
		t.Run(m.name, func(t *testing.T) {
			check(t, migratedPool(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = m.mode }))
		})
	}
	t.Run("sql_ascii", func(t *testing.T) {
		pool := pgtest.PoolOn(t, pgtest.DatabaseWith(t, pgtest.SQLASCII))
		migrate(t, pool)
		check(t, pool)
	})
}

// TestClaimsOfOneKeyGiveOneLease has many claims of one key race, each
// with its own owner, on a pool whose sessions default to each isolation
// level: exactly one gets a lease, every other one a 409 (or the record,
// once it completed), and none fails.
func TestClaimsOfOneKeyGiveOneLease(t *testing.T) {
	for _, iso := range []string{"read committed", "repeatable read", "serializable"} {
		t.Run(iso, func(t *testing.T) {
			ctx := context.Background()
			pool := migratedPool(t, pgtest.MaxConns(12), func(c *pgxpool.Config) {
				c.ConnConfig.RuntimeParams["default_transaction_isolation"] = iso
			})
			s := pgstore.New(pool, pgstore.Options{})
			const keys, claimers = 20, 12
			for k := range keys {
				key := fmt.Sprintf("race-%d", k)
				leases, errs := raceClaims(ctx, s, key, claimers)
				if leases != 1 || len(errs) > 0 {
					t.Fatalf("key %s: %d leases, errors %v; want 1 lease, the others in flight", key, leases, errs)
				}
			}
			if !pgstore.ClaimFuncInUse(s) {
				t.Errorf("claims fell back to the insert-or-read statement")
			}
		})
	}
}

// TestClaimFunctionMatchesInsertOrRead compares idem_claim and the
// insert-or-read statement on the same arguments, with the test clock set:
// every column they return, and the row each inserts, must be equal,
// both for a free key and for one whose row exists.
func TestClaimFunctionMatchesInsertOrRead(t *testing.T) {
	ctx := context.Background()
	pool := migratedPool(t)
	at := time.Date(2030, 1, 2, 3, 4, 5, 123456000, time.UTC)
	args := func(key string, at any) []any {
		return []any{pgx.QueryExecModeCacheDescribe, "u", key, "fp", "POST", "/v1/orders", `{"A":["b"]}`, []byte("body"),
			"owner-1", 90 * time.Second, 36*time.Hour + time.Microsecond, at}
	}
	read := func(statement, key string, at any) []any {
		rows, err := pool.Query(ctx, statement, args(key, at)...)
		if err != nil {
			t.Fatal(err)
		}
		vals, err := pgx.CollectExactlyOneRow(rows, func(r pgx.CollectableRow) ([]any, error) { return r.Values() })
		if err != nil {
			t.Fatalf("%s: %v", statement, err)
		}
		return vals
	}
	fn := `SELECT * FROM idem_claim($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'idempotency_keys'::regclass)`
	row := func(key string) string {
		var s string
		if err := pool.QueryRow(ctx, `SELECT to_jsonb(k) - 'key' FROM idempotency_keys k WHERE key = $1`, key).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	for _, at := range []any{at, nil} {
		fnKey, stKey := fmt.Sprintf("fn-%v", at == nil), fmt.Sprintf("st-%v", at == nil)
		for round := range 2 { // a free key, then the row it inserted
			got, want := read(fn, fnKey, at), read(pgstore.InsertOrReadSQL, stKey, at)
			if len(got) != len(want) {
				t.Fatalf("round %d: %d columns, want %d", round, len(got), len(want))
			}
			for i := range got {
				if at == nil && (i == 3 || i == 6 || i == 7 || i == 12) {
					continue // the database's clock: not the same instant
				}
				if fmt.Sprint(got[i]) != fmt.Sprint(want[i]) {
					t.Errorf("at %v, round %d, column %d: function %v, statement %v", at, round, i, got[i], want[i])
				}
			}
		}
		if at != nil {
			if got, want := row(fnKey), row(stKey); got != want {
				t.Errorf("rows differ:\nfunction  %s\nstatement %s", got, want)
			}
		}
	}
}

// TestClaimStoresTheSameRowAsTheStatement claims through idem_claim and,
// on a schema without it, through the insert-or-read statement, in each
// of pgx's modes and on a SQL_ASCII database, with the test clock set:
// the rows stored (header as
// jsonb, body as bytea, lease and expiry from intervals) and the claims
// returned must be equal, and a second claim must read the same back.
func TestClaimStoresTheSameRowAsTheStatement(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2030, 1, 2, 3, 4, 5, 123456789, time.UTC)
	p := claimParams("same-row")
	p.Owner = "fixed-owner"
	p.Header = map[string][]string{"X-Ünïcode": {"välue ✓", ""}, "Content-Type": {"application/json"}}
	p.Body = []byte{0, 1, 0xfe, 0xff, '\\', 'x', '\''}
	p.Lease = 90*time.Second + 1500*time.Microsecond
	p.TTL = 49*time.Hour + 7*time.Microsecond
	compare := func(t *testing.T, withFn, withoutFn *pgxpool.Pool) {
		if _, err := withoutFn.Exec(ctx, `DROP FUNCTION idem_claim`); err != nil {
			t.Fatal(err)
		}
		var rows, claims, again []string
		for _, pool := range []*pgxpool.Pool{withFn, withoutFn} {
			s := pgstore.New(pool, pgstore.Options{Now: func() time.Time { return now }})
			c, err := s.Claim(ctx, p)
			if err != nil || c.Lease == nil {
				t.Fatalf("claim: %+v, %v", c, err)
			}
			claims = append(claims, fmt.Sprintf("%+v %v", *c.Lease, c.ExpiresIn))
			// The same owner again: the lease as stored, read back.
			c, err = s.Claim(ctx, p)
			if err != nil || c.Lease == nil {
				t.Fatalf("claim again: %+v, %v", c, err)
			}
			again = append(again, fmt.Sprintf("%+v %v", *c.Lease, c.ExpiresIn))
			var row string
			if err := pool.QueryRow(ctx, `SELECT to_jsonb(k)::text FROM idempotency_keys k`, pgx.QueryExecModeExec).Scan(&row); err != nil {
				t.Fatal(err)
			}
			rows = append(rows, row)
			if pgstore.ClaimFuncInUse(s) != (pool == withFn) {
				t.Errorf("claims call idem_claim: %v, want %v", pgstore.ClaimFuncInUse(s), pool == withFn)
			}
		}
		for i, pair := range [][]string{rows, claims, again} {
			if pair[0] != pair[1] {
				t.Errorf("%d: through idem_claim\n\t%s\nthrough the statement\n\t%s", i, pair[0], pair[1])
			}
		}
	}
	for _, m := range execModes {
		t.Run(m.name, func(t *testing.T) {
			mode := func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = m.mode }
			compare(t, migratedPool(t, mode), migratedPool(t, mode))
		})
	}
	t.Run("sql_ascii", func(t *testing.T) {
		url := pgtest.DatabaseWith(t, pgtest.SQLASCII)
		withFn, withoutFn := pgtest.PoolOn(t, url), pgtest.PoolOn(t, url)
		migrate(t, withFn)
		migrate(t, withoutFn)
		compare(t, withFn, withoutFn)
	})
}

// raceClaims has n claims of key, each with its own owner, start at once
// on s, and returns how many got a lease and the claims that got neither a
// lease nor a 409.
func raceClaims(ctx context.Context, s *pgstore.Store, key string, n int) (leases int, errs []error) {
	var (
		wg sync.WaitGroup
		mu sync.Mutex
	)
	start := make(chan struct{})
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			c, err := s.Claim(ctx, claimParams(key))
			mu.Lock()
			defer mu.Unlock()
			var inflight *idem.InFlightError
			switch {
			case err == nil && c.Lease != nil:
				leases++
			case errors.As(err, &inflight):
			default:
				errs = append(errs, fmt.Errorf("%+v, %w", c, err))
			}
		}()
	}
	close(start)
	wg.Wait()
	return leases, errs
}
