package everystore_test

// Adversarial second reading of idemdriver.Inspector (inspect.go) and its
// implementations: states against what Claim and Abandoned decide, at the
// lease's and the expiry's exact boundaries; Redrive across operations of
// one key; limits and odd keys; Redrive racing completers, a client's
// retries and a stale attempt's late commit, on every store.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math"
	mrand "math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/redisfront"
	"github.com/idem-go/idem/sqlitestore"
	"github.com/idem-go/idem/storetest"
)

// inspectStore is a store under test, with a way to write an effect in its
// transaction and count the effects committed.
type inspectStore struct {
	idem.Store
	base  idem.Store // the store itself, for the middleware and the completer
	in    idemdriver.Inspector
	sw    idemdriver.Sweeper
	write func(ctx context.Context, tx idem.Tx, name string) error
	count func(t *testing.T, name string) int
}

// inspectKinds are the stores every rdv case runs on: memstore and SQLite
// always, PostgreSQL with TEST_DATABASE_URL (or CI=true), and redisfront in
// front of memstore and of PostgreSQL with TEST_REDIS_URL too.
//
// sqlite2 is SQLite with the operator's calls (Inspector) on a second
// handle of the same file, as `orders keys` runs in a process of its own
// beside serve: only SQLite's own lock keeps its Redrive and serve's
// claims apart.
var inspectKinds = []string{"mem", "sqlite", "sqlite2", "pg", "redis-mem", "redis-pg"}

// inspectRedis returns a client of the tests' Redis and a key prefix of t's
// own (deleted when t ends), or skips t.
func inspectRedis(t *testing.T) (*redis.Client, string) {
	t.Helper()
	u := os.Getenv("TEST_REDIS_URL")
	if u == "" {
		if os.Getenv("CI") != "true" {
			t.Skip("Redis cases skipped: set TEST_REDIS_URL (e.g. redis://127.0.0.1:6379) or CI=true")
		}
		u = "redis://127.0.0.1:6379"
	}
	opt, err := redis.ParseURL(u)
	if err != nil {
		t.Fatalf("TEST_REDIS_URL %q: %v", u, err)
	}
	opt.ContextTimeoutEnabled = true
	rdb := redis.NewClient(opt)
	var b [6]byte
	rand.Read(b[:])
	prefix := "rdvtest:" + hex.EncodeToString(b[:]) + ":"
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		iter := rdb.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			rdb.Del(ctx, iter.Val())
		}
		rdb.Close()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Fatalf("Redis at %s does not answer: %v", u, err)
	}
	return rdb, prefix
}

// newInspectStore makes a fresh store of kind whose clock is now (nil: the
// store's own, the database's for PostgreSQL).
func newInspectStore(t *testing.T, kind string, now func() time.Time) *inspectStore {
	t.Helper()
	ctx := context.Background()
	var (
		inner    idem.Store
		operator idemdriver.Inspector // nil: the store itself
		write    func(ctx context.Context, tx idem.Tx, name string) error
		count    func(t *testing.T, name string) int
	)
	switch kind {
	case "mem", "redis-mem":
		var mu sync.Mutex
		effects := map[string]int{}
		inner = memstore.New(memstore.Options{Now: now})
		write = func(ctx context.Context, tx idem.Tx, name string) error {
			mtx, ok := idemdriver.UnwrapTx(tx).(*memstore.Tx)
			if !ok {
				return fmt.Errorf("%T is not a memstore transaction", tx)
			}
			mtx.OnCommit(func() { mu.Lock(); effects[name]++; mu.Unlock() })
			return nil
		}
		count = func(t *testing.T, name string) int { mu.Lock(); defer mu.Unlock(); return effects[name] }
	case "sqlite", "sqlite2":
		path := filepath.Join(t.TempDir(), "rdv.db")
		s, err := sqlitestore.Open(ctx, path, sqlitestore.Options{Now: now})
		if err != nil {
			t.Fatalf("sqlitestore.Open: %v", err)
		}
		t.Cleanup(func() { s.Close() })
		if kind == "sqlite2" {
			op, err := sqlitestore.Open(ctx, path, sqlitestore.Options{Now: now})
			if err != nil {
				t.Fatalf("sqlitestore.Open, second handle: %v", err)
			}
			t.Cleanup(func() { op.Close() })
			operator = op
		}
		if _, err := s.DB().Exec(`CREATE TABLE rdv_effects (name TEXT NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		inner = s
		write = func(ctx context.Context, tx idem.Tx, name string) error {
			stx, ok := idemdriver.UnwrapTx(tx).(*sqlitestore.Tx)
			if !ok {
				return fmt.Errorf("%T is not a sqlitestore transaction", tx)
			}
			_, err := stx.SQL().ExecContext(ctx, `INSERT INTO rdv_effects (name) VALUES (?)`, name)
			return err
		}
		count = func(t *testing.T, name string) int {
			var n int
			if err := s.DB().QueryRow(`SELECT count(*) FROM rdv_effects WHERE name = ?`, name).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
	case "pg", "redis-pg":
		pool := pgtest.Pool(t, pgtest.MaxConns(8))
		if err := pgstore.Migrate(ctx, pool); err != nil {
			t.Fatalf("Migrate: %v", err)
		}
		if _, err := pool.Exec(ctx, `CREATE TABLE rdv_effects (name text NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		inner = pgstore.New(pool, pgstore.Options{Now: now})
		write = func(ctx context.Context, tx idem.Tx, name string) error {
			ptx, ok := idemdriver.UnwrapTx(tx).(*pgstore.Tx)
			if !ok {
				return fmt.Errorf("%T is not a pgstore transaction", tx)
			}
			_, err := ptx.PgxTx().Exec(ctx, `INSERT INTO rdv_effects (name) VALUES ($1)`, name)
			return err
		}
		count = func(t *testing.T, name string) int {
			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM rdv_effects WHERE name = $1`, name).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
	default:
		t.Fatalf("unknown kind %s", kind)
	}
	s := inner
	if kind == "redis-mem" || kind == "redis-pg" {
		rdb, prefix := inspectRedis(t)
		s = redisfront.New(rdb, inner, redisfront.Options{Timeout: 2 * time.Second, KeyPrefix: prefix, Now: now})
	}
	if operator == nil {
		operator = s.(idemdriver.Inspector)
	}
	return &inspectStore{Store: s, base: s, in: operator, sw: s.(idemdriver.Sweeper), write: write, count: count}
}

// forKinds runs fn on a fresh store of every kind, in parallel.
func forKinds(t *testing.T, clocked bool, fn func(t *testing.T, s *inspectStore, clk *storetest.Clock)) {
	for _, kind := range inspectKinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			var clk *storetest.Clock
			var now func() time.Time
			if clocked {
				clk = storetest.NewClock(time.Date(2031, 3, 4, 5, 6, 7, 0, time.UTC))
				now = clk.Now
			}
			fn(t, newInspectStore(t, kind, now), clk)
		})
	}
}

func inspectParams(user, key, fp string, lease time.Duration) idemdriver.ClaimParams {
	return idemdriver.ClaimParams{User: user, Key: key, Fingerprint: fp, Owner: idemdriver.NewOwner(),
		Method: "POST", Path: "/v1/orders", Body: []byte(`{"n":1}`), Lease: lease, TTL: time.Hour}
}

func inspectLease(t *testing.T, s idem.Store, p idemdriver.ClaimParams) *idemdriver.Lease {
	t.Helper()
	c, err := s.Claim(context.Background(), p)
	if err != nil || c.Lease == nil {
		t.Fatalf("Claim(%s/%s) = %+v, %v; want a lease", p.User, p.Key, c, err)
	}
	return c.Lease
}

// leaseWithRedrives has completers (budget `budget`, no backoff) take over and
// fail (user, key)'s operation created at created, n times.
func leaseWithRedrives(t *testing.T, s idem.Store, p idemdriver.ClaimParams, created time.Time, n, budget int) *idemdriver.Lease {
	t.Helper()
	var l *idemdriver.Lease
	for range n {
		q := p
		q.Owner = idemdriver.NewOwner()
		q.Redrive = &idemdriver.RedriveParams{CreatedAt: created, Due: idemdriver.AbandonedParams{MaxRedrives: budget}}
		l = inspectLease(t, s, q)
		if err := s.Fail(context.Background(), l); err != nil {
			t.Fatalf("Fail: %v", err)
		}
	}
	return l
}

// TestInspectStatesAgreeWithClaim: at the lease's end exactly, a µs before
// it, at the expiry exactly and a µs before it, with re-drives just under,
// at and over the budget, the state InspectKey and ListKeys give a key is
// the one Claim, Abandoned and Redrive act on: in-flight ⇔ Claim answers
// in flight; abandoned ⇔ Abandoned lists it (no backoff) and Redrive
// refuses it; given-up ⇔ Abandoned leaves it out and Redrive takes it;
// completed ⇔ Claim replays; not found ⇔ Claim starts a new operation.
func TestInspectStatesAgreeWithClaim(t *testing.T) {
	const budget = 3
	forKinds(t, true, func(t *testing.T, s *inspectStore, clk *storetest.Clock) {
		ctx := context.Background()
		const lease = 10 * time.Second
		// The clock is moved to T below; each key is set up so that at T
		// its lease or expiry is at the boundary named.
		T := clk.Now().Add(time.Minute)
		type kc struct {
			key  string
			want idemdriver.KeyState // "" : not found
		}
		var cases []kc
		// Leases: claimed so that the lease ends at T+d.
		for _, c := range []struct {
			name     string
			end      time.Duration // lease end − T
			redrives int
			want     idemdriver.KeyState
		}{
			{"lease-ends-at-T", 0, 0, idemdriver.KeyAbandoned},
			{"lease-ends-1us-after-T", time.Microsecond, 0, idemdriver.KeyInFlight},
			{"lease-ended-1us-before-T", -time.Microsecond, 0, idemdriver.KeyAbandoned},
			{"given-up-lease-ends-at-T", 0, budget, idemdriver.KeyGivenUp},
			{"given-up-lease-ends-1us-after-T", time.Microsecond, budget, idemdriver.KeyInFlight},
			{"one-under-budget", 0, budget - 1, idemdriver.KeyAbandoned},
			{"over-budget", 0, budget + 1, idemdriver.KeyGivenUp},
		} {
			p := inspectParams("u", c.name, "fp", lease)
			first := inspectLease(t, s, p)
			if err := s.Fail(ctx, first); err != nil {
				t.Fatal(err)
			}
			leaseWithRedrives(t, s, p, first.CreatedAt, c.redrives, budget+1)
			// The last takeover: a client's, whose lease ends at T+end.
			q := p
			q.Owner = idemdriver.NewOwner()
			q.Lease = T.Add(c.end).Sub(clk.Now())
			last := inspectLease(t, s, q)
			if !last.Until.Equal(T.Add(c.end)) {
				t.Fatalf("%s: lease until %v, want %v", c.name, last.Until, T.Add(c.end))
			}
			clk.Advance(time.Microsecond) // keys apart in time
			cases = append(cases, kc{c.name, c.want})
		}
		// Expiry: completed so that the record expires at T+d.
		for _, c := range []struct {
			name string
			exp  time.Duration
			want idemdriver.KeyState
		}{
			{"expires-at-T", 0, ""},
			{"expires-1us-after-T", time.Microsecond, idemdriver.KeyCompleted},
		} {
			p := inspectParams("u", c.name, "fp", lease)
			p.TTL = T.Add(c.exp).Sub(clk.Now())
			l := inspectLease(t, s, p)
			tx, err := s.Begin(ctx, l)
			if err != nil {
				t.Fatal(err)
			}
			if err := tx.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte("ok")}); err != nil {
				t.Fatal(err)
			}
			clk.Advance(time.Microsecond)
			cases = append(cases, kc{c.name, c.want})
		}
		if clk.Now().After(T) {
			t.Fatalf("setup ran past T")
		}
		clk.Advance(T.Sub(clk.Now()))

		listed := map[string]idemdriver.KeyState{}
		for _, st := range idemdriver.KeyStates {
			for _, limit := range []int{math.MaxInt, math.MaxInt32 + 1, 1000} {
				infos, err := s.in.ListKeys(ctx, idemdriver.ListParams{State: st, Limit: limit, MaxRedrives: budget})
				if err != nil {
					t.Fatalf("ListKeys(%s, limit %d): %v", st, limit, err)
				}
				for _, in := range infos {
					if prev, ok := listed[in.Key]; ok && prev != st {
						t.Errorf("%s listed as %s and as %s", in.Key, prev, st)
					}
					listed[in.Key] = st
					if !in.At.Equal(T) {
						t.Errorf("ListKeys(%s): %s at %v, want %v", st, in.Key, in.At, T)
					}
				}
			}
		}
		due, err := s.sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 1000, MaxRedrives: budget})
		if err != nil {
			t.Fatal(err)
		}
		isDue := map[string]bool{}
		for _, r := range due {
			isDue[r.Key] = true
		}
		for _, c := range cases {
			info, err := s.in.InspectKey(ctx, "u", c.key, budget)
			got := idemdriver.KeyState("")
			if err == nil {
				got = info.State
			} else if !errors.Is(err, idem.ErrNotFound) {
				t.Errorf("InspectKey(%s): %v", c.key, err)
				continue
			}
			if got != c.want || listed[c.key] != c.want {
				t.Errorf("%s: InspectKey %q, ListKeys %q; want %q", c.key, got, listed[c.key], c.want)
			}
			if isDue[c.key] != (c.want == idemdriver.KeyAbandoned) {
				t.Errorf("%s (%s): Abandoned lists it: %v", c.key, c.want, isDue[c.key])
			}
		}
		// Redrive, at T: only the given-up keys, and only their count.
		for _, c := range cases {
			before, _ := s.Get(ctx, "u", c.key)
			n, err := s.in.Redrive(ctx, "u", c.key, budget)
			after, _ := s.Get(ctx, "u", c.key)
			switch c.want {
			case idemdriver.KeyGivenUp:
				if err != nil || n != before.Redrives || after.Redrives != 0 || after.Owner != before.Owner ||
					!after.LeaseUntil.Equal(before.LeaseUntil) || after.Attempts != before.Attempts || !after.CreatedAt.Equal(before.CreatedAt) {
					t.Errorf("%s: Redrive = %d, %v; record %+v → %+v", c.key, n, err, before, after)
				}
			case "":
				if !errors.Is(err, idem.ErrNotFound) {
					t.Errorf("%s: Redrive = %d, %v; want ErrNotFound", c.key, n, err)
				}
			default:
				var ng *idemdriver.NotGivenUpError
				if !errors.As(err, &ng) || ng.State != c.want || after.Redrives != before.Redrives {
					t.Errorf("%s: Redrive = %d, %v (redrives %d → %d); want refused as %s", c.key, n, err, before.Redrives, after.Redrives, c.want)
				}
			}
		}
		// A client's claim at T, same request: what the state promised.
		for _, c := range cases {
			q := inspectParams("u", c.key, "fp", lease)
			cl, err := s.Claim(ctx, q)
			switch c.want {
			case idemdriver.KeyInFlight:
				if !errors.Is(err, idem.ErrInFlight) {
					t.Errorf("%s (in flight): Claim = %+v, %v; want in flight", c.key, cl, err)
				}
			case idemdriver.KeyAbandoned, idemdriver.KeyGivenUp:
				if err != nil || cl.Lease == nil || cl.Lease.Attempt < 2 {
					t.Errorf("%s (%s): Claim = %+v, %v; want a takeover", c.key, c.want, cl, err)
				}
			case idemdriver.KeyCompleted:
				if err != nil || cl.Response == nil {
					t.Errorf("%s (completed): Claim = %+v, %v; want a replay", c.key, cl, err)
				}
			case "":
				if err != nil || cl.Lease == nil || cl.Lease.Attempt != 1 || !cl.Lease.CreatedAt.Equal(T) {
					t.Errorf("%s (expired): Claim = %+v, %v; want a new operation", c.key, cl, err)
				}
			}
		}
	})
}

// TestListKeysLimitsAndBudgets: ListKeys with a limit of 0, negative,
// math.MinInt or math.MaxInt, and budgets of 0, negative and math.MaxInt,
// answers without an error and agrees with InspectKey (the budget <= 0
// is DefaultCompleterMaxAttempts; a budget over any count gives nothing
// up); an unknown state is refused whatever the limit.
func TestListKeysLimitsAndBudgets(t *testing.T) {
	forKinds(t, true, func(t *testing.T, s *inspectStore, clk *storetest.Clock) {
		ctx := context.Background()
		p := inspectParams("u", "k", "fp", time.Second)
		first := inspectLease(t, s, p)
		if err := s.Fail(ctx, first); err != nil {
			t.Fatal(err)
		}
		leaseWithRedrives(t, s, p, first.CreatedAt, idem.DefaultCompleterMaxAttempts, idem.DefaultCompleterMaxAttempts)
		clk.Advance(time.Second)
		for _, limit := range []int{0, -1, math.MinInt} {
			for _, st := range idemdriver.KeyStates {
				if infos, err := s.in.ListKeys(ctx, idemdriver.ListParams{State: st, Limit: limit}); err != nil || len(infos) != 0 {
					t.Errorf("ListKeys(%s, limit %d) = %d keys, %v; want none", st, limit, len(infos), err)
				}
			}
			if _, err := s.in.ListKeys(ctx, idemdriver.ListParams{State: "given_up", Limit: limit}); err == nil {
				t.Errorf("ListKeys(unknown state, limit %d): no error", limit)
			}
		}
		for _, c := range []struct {
			budget int
			want   idemdriver.KeyState
		}{
			{0, idemdriver.KeyGivenUp}, {-1, idemdriver.KeyGivenUp}, {math.MinInt, idemdriver.KeyGivenUp},
			{idem.DefaultCompleterMaxAttempts, idemdriver.KeyGivenUp},
			{idem.DefaultCompleterMaxAttempts + 1, idemdriver.KeyAbandoned},
			{math.MaxInt32, idemdriver.KeyAbandoned}, {math.MaxInt32 + 1, idemdriver.KeyAbandoned}, {math.MaxInt, idemdriver.KeyAbandoned},
		} {
			info, err := s.in.InspectKey(ctx, "u", "k", c.budget)
			if err != nil || info.State != c.want {
				t.Errorf("InspectKey(budget %d) = %+v, %v; want %s", c.budget, info, err, c.want)
			}
			infos, err := s.in.ListKeys(ctx, idemdriver.ListParams{State: c.want, Limit: math.MaxInt, MaxRedrives: c.budget})
			if err != nil || len(infos) != 1 || infos[0].Key != "k" {
				t.Errorf("ListKeys(%s, budget %d, limit MaxInt) = %d keys, %v; want k", c.want, c.budget, len(infos), err)
			}
		}
	})
}

// TestInspectOddKeys: users and keys that look like SQL, patterns, or that
// differ only in case, trailing space or a NUL-free Unicode twin name
// exactly one record each: InspectKey, ListKeys and Redrive never touch
// another key, and the table survives.
func TestInspectOddKeys(t *testing.T) {
	odd := []string{
		`'; DROP TABLE idempotency_keys; --`, `" OR 1=1 --`, `%`, `_`, `k%`, `K`, `k`, `k `, `\`, `$1`, `:now`, `?`,
		"k\u0130", "\u212a", // İ and the Kelvin sign (folds to k)
	}
	forKinds(t, true, func(t *testing.T, s *inspectStore, clk *storetest.Clock) {
		ctx := context.Background()
		const budget = 1
		for i, k := range odd {
			user := odd[len(odd)-1-i]
			p := inspectParams(user, k, "fp-"+k, time.Second)
			l := inspectLease(t, s, p)
			if err := s.Fail(ctx, l); err != nil {
				t.Fatal(err)
			}
			if i%2 == 0 {
				leaseWithRedrives(t, s, p, l.CreatedAt, budget, budget)
			}
			clk.Advance(time.Microsecond)
		}
		clk.Advance(time.Second)
		given, err := s.in.ListKeys(ctx, idemdriver.ListParams{State: idemdriver.KeyGivenUp, Limit: 100, MaxRedrives: budget})
		if err != nil {
			t.Fatal(err)
		}
		aband, err := s.in.ListKeys(ctx, idemdriver.ListParams{State: idemdriver.KeyAbandoned, Limit: 100, MaxRedrives: budget})
		if err != nil {
			t.Fatal(err)
		}
		if len(given)+len(aband) != len(odd) || len(given) != (len(odd)+1)/2 {
			t.Fatalf("%d given up, %d abandoned; want %d and %d", len(given), len(aband), (len(odd)+1)/2, len(odd)/2)
		}
		for i, k := range odd {
			user := odd[len(odd)-1-i]
			info, err := s.in.InspectKey(ctx, user, k, budget)
			if err != nil || info.Key != k || info.User != user || info.Fingerprint != "fp-"+k {
				t.Errorf("InspectKey(%q, %q) = %+v, %v", user, k, info, err)
				continue
			}
			n, err := s.in.Redrive(ctx, user, k, budget)
			if (i%2 == 0) != (err == nil) || (err == nil && n != budget) {
				t.Errorf("Redrive(%q, %q) = %d, %v (given up: %v)", user, k, n, err, i%2 == 0)
			}
		}
		for i, k := range odd {
			user := odd[len(odd)-1-i]
			rec, err := s.Get(ctx, user, k)
			if err != nil || rec.Redrives != 0 || rec.Fingerprint != "fp-"+k {
				t.Errorf("after the Redrives, Get(%q, %q) = %+v, %v; want 0 re-drives", user, k, rec, err)
			}
			// Another user's key of the same name is not found.
			if _, err := s.in.InspectKey(ctx, user+"x", k, budget); !errors.Is(err, idem.ErrNotFound) {
				t.Errorf("InspectKey(%q, %q) = %v; want ErrNotFound", user+"x", k, err)
			}
		}
	})
}

// TestRedriveAcrossOperations: an operation (A) given up, then finished
// by its client's retry, expires; its key is used again (operation B, another
// request), which the completers give up too. Redrive then resets B's
// count and nothing else; a completer holding a listing of A cannot take
// B over (ErrNotDue) before or after, and B's lease goes only to a claim
// naming B.
//
// Note: Redrive names (user, key), not an operation, so an operator who
// looked at A (orders keys show) and redrives later re-drives B; the
// returned count is B's. Safe (B's own claims are fenced), but the caller
// cannot say "only the operation I looked at"; see the report.
func TestRedriveAcrossOperations(t *testing.T) {
	const budget = 2
	forKinds(t, true, func(t *testing.T, s *inspectStore, clk *storetest.Clock) {
		ctx := context.Background()
		pa := inspectParams("u", "k", "fp-A", time.Second)
		pa.TTL = time.Minute
		a := inspectLease(t, s, pa)
		if err := s.Fail(ctx, a); err != nil {
			t.Fatal(err)
		}
		staleA := leaseWithRedrives(t, s, pa, a.CreatedAt, budget, budget)
		if _, err := s.in.InspectKey(ctx, "u", "k", budget); err != nil {
			t.Fatal(err)
		}
		// The client's retry finishes A.
		q := pa
		q.Owner = idemdriver.NewOwner()
		l := inspectLease(t, s, q)
		tx, err := s.Begin(ctx, l)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.write(ctx, tx, "A"); err != nil {
			t.Fatal(err)
		}
		if err := tx.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte("A")}); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Minute) // A expires
		if n, err := s.in.Redrive(ctx, "u", "k", budget); !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("Redrive of an expired completed key = %d, %v; want ErrNotFound", n, err)
		}
		// B: another request with the same key.
		pb := inspectParams("u", "k", "fp-B", time.Second)
		b := inspectLease(t, s, pb)
		if b.CreatedAt.Equal(a.CreatedAt) || b.Attempt != 1 {
			t.Fatalf("B's lease %+v: want a new operation", b)
		}
		if err := s.Fail(ctx, b); err != nil {
			t.Fatal(err)
		}
		leaseWithRedrives(t, s, pb, b.CreatedAt, budget, budget)
		staleClaim := func(when string) {
			t.Helper()
			qa := pa
			qa.Owner = idemdriver.NewOwner()
			qa.Redrive = &idemdriver.RedriveParams{CreatedAt: a.CreatedAt, Due: idemdriver.AbandonedParams{MaxRedrives: budget}}
			if cl, err := s.Claim(ctx, qa); !errors.Is(err, idem.ErrNotDue) && !errors.Is(err, idem.ErrFingerprintMismatch) {
				t.Errorf("%s: a completer's claim of A = %+v, %v; want ErrNotDue", when, cl, err)
			}
		}
		staleClaim("B given up")
		before, _ := s.Get(ctx, "u", "k")
		n, err := s.in.Redrive(ctx, "u", "k", budget)
		if err != nil || n != budget {
			t.Fatalf("Redrive of B = %d, %v", n, err)
		}
		after, _ := s.Get(ctx, "u", "k")
		if after.Fingerprint != "fp-B" || !after.CreatedAt.Equal(b.CreatedAt) || after.Owner != before.Owner || after.Redrives != 0 || after.Response != nil {
			t.Errorf("Redrive changed B: %+v → %+v", before, after)
		}
		staleClaim("B re-driven")
		// A's stale attempt cannot commit into B.
		tx, err = s.Begin(ctx, staleA)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.write(ctx, tx, "A"); err != nil {
			t.Fatal(err)
		}
		if err := tx.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte("stale A")}); !errors.Is(err, idem.ErrFenced) {
			t.Errorf("A's stale attempt after B's Redrive: Complete = %v; want ErrFenced", err)
		}
		qb := pb
		qb.Owner = idemdriver.NewOwner()
		qb.Redrive = &idemdriver.RedriveParams{CreatedAt: b.CreatedAt, Due: idemdriver.AbandonedParams{MaxRedrives: budget}}
		if cl, err := s.Claim(ctx, qb); err != nil || cl.Lease == nil || !cl.Lease.CreatedAt.Equal(b.CreatedAt) {
			t.Errorf("a completer's claim of B after Redrive = %+v, %v; want B's lease", cl, err)
		}
		if got := s.count(t, "A"); got != 1 {
			t.Errorf("A's effects = %d, want 1", got)
		}
	})
}

// inspectGateway stands for the payment gateway: it counts charges by their
// idempotency key (the lease's ChildKey("payment"), the same for every
// attempt at one operation).
type inspectGateway struct {
	mu      sync.Mutex
	charges map[string]int // payment key → calls
	byKey   map[string]map[string]bool
}

func (g *inspectGateway) charge(key, payment string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.charges[payment]++
	if g.byKey[key] == nil {
		g.byKey[key] = map[string]bool{}
	}
	g.byKey[key][payment] = true
}

// TestRedriveRacedRepeatedly: on every store, with its real clock, round
// after round a key is given up by completers (budget 2) and then raced
// by two completers scanning, an operator who re-drives it whenever it
// is given up, its client retrying through the middleware, and the last
// attempt, whose lease ended without a takeover, committing late; the
// handler fails a random number of times first. Each round the key ends
// with exactly one order, one payment key (charged however often, the
// gateway deduplicates it) whose order exists, a stored 201, and no two
// handlers ever ran on the key at once.
func TestRedriveRacedRepeatedly(t *testing.T) {
	if testing.Short() {
		t.Skip("race rounds skipped in -short")
	}
	const budget = 2
	forKinds(t, false, func(t *testing.T, s *inspectStore, _ *storetest.Clock) {
		ctx := context.Background()
		rounds := 25
		if testing.Verbose() {
			rounds = 40
		}
		gw := &inspectGateway{charges: map[string]int{}, byKey: map[string]map[string]bool{}}
		var (
			mu       sync.Mutex
			failLeft = map[string]int{}
			running  = map[string]int{}
			overlaps []string
		)
		handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			l, ok := idem.LeaseFromContext(r.Context())
			if !ok {
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			mu.Lock()
			running[l.Key]++
			if running[l.Key] > 1 {
				overlaps = append(overlaps, l.Key)
			}
			fail := failLeft[l.Key] > 0
			failLeft[l.Key]--
			mu.Unlock()
			defer func() { mu.Lock(); running[l.Key]--; mu.Unlock() }()
			gw.charge(l.Key, l.ChildKey("payment"))
			if fail {
				w.WriteHeader(http.StatusBadGateway)
				return
			}
			tx, err := idem.TxFromContext(r.Context())
			if err == nil {
				err = s.write(r.Context(), tx, "order:"+l.Key)
			}
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.WriteHeader(http.StatusCreated)
			w.Write([]byte(`{"order":"` + l.ChildKey("order") + `"}`))
		})
		mopts := idem.Options{
			Lease: 10 * time.Second, TTL: time.Hour,
			User:        func(r *http.Request) string { return r.Header.Get("X-User") },
			Fingerprint: func(*http.Request, []byte) (string, error) { return "fp", nil },
			Logger:      slog.New(slog.DiscardHandler),
		}
		client := idem.Middleware(s.base, mopts)(handler)
		newCompleter := func() *idem.Completer {
			c := idem.NewCompleter(s.base.(idemdriver.SweepingStore), handler, idem.CompleterOptions{
				MaxAttempts: budget, Backoff: time.Microsecond, MaxBackoff: time.Microsecond, Batch: 10,
				Middleware: mopts, Logger: slog.New(slog.DiscardHandler),
			})
			return c
		}
		c1, c2 := newCompleter(), newCompleter()
		redriven, clientWon, staleWon := 0, 0, 0
		for round := range rounds {
			key := fmt.Sprintf("race-%d", round)
			p := idemdriver.ClaimParams{User: "u", Key: key, Fingerprint: "fp", Method: http.MethodPost, Path: "/v1/orders",
				Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"n":1}`), Lease: 10 * time.Second, TTL: time.Hour}
			p.Owner = idemdriver.NewOwner()
			first := inspectLease(t, s, p)
			if err := s.Fail(ctx, first); err != nil {
				t.Fatal(err)
			}
			stale := leaseWithRedrives(t, s, p, first.CreatedAt, budget, budget)
			mu.Lock()
			failLeft[key] = int(first.CreatedAt.UnixNano()/1000) % 6
			mu.Unlock()

			var (
				wg    sync.WaitGroup
				start = make(chan struct{})
				done  = make(chan struct{})
				once  sync.Once
				emu   sync.Mutex
				errs  []error
			)
			report := func(err error) { emu.Lock(); errs = append(errs, err); emu.Unlock() }
			finish := func() { once.Do(func() { close(done) }) }
			isDone := func() bool {
				select {
				case <-done:
					return true
				default:
					return false
				}
			}
			for _, c := range []*idem.Completer{c1, c2} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					for range 40 {
						if isDone() {
							return
						}
						if _, err := c.RunOnce(ctx); err != nil {
							report(fmt.Errorf("RunOnce: %w", err))
							return
						}
						runtime.Gosched()
					}
				}()
			}
			wg.Add(3)
			go func() { // the operator
				defer wg.Done()
				<-start
				for range 200 {
					if isDone() {
						return
					}
					info, err := s.in.InspectKey(ctx, "u", key, budget)
					switch {
					case err != nil:
						report(fmt.Errorf("InspectKey: %w", err))
						return
					case info.State == idemdriver.KeyCompleted:
						finish()
						return
					case info.State == idemdriver.KeyGivenUp:
						n, err := s.in.Redrive(ctx, "u", key, budget)
						switch {
						case err == nil:
							if n < budget {
								report(fmt.Errorf("Redrive reset %d re-drives, under the budget %d", n, budget))
							}
							mu.Lock()
							redriven++
							mu.Unlock()
						case errors.Is(err, idemdriver.ErrNotGivenUp):
							// taken over or completed since the look
						default:
							report(fmt.Errorf("Redrive: %w", err))
						}
					}
					runtime.Gosched()
				}
			}()
			go func() { // the client's retries
				defer wg.Done()
				<-start
				for range 40 {
					if isDone() {
						return
					}
					req := httptest.NewRequest(http.MethodPost, "/v1/orders", strings.NewReader(`{"n":1}`))
					req.Header.Set("Idempotency-Key", key)
					req.Header.Set("X-User", "u")
					req.Header.Set("Content-Type", "application/json")
					rec := httptest.NewRecorder()
					client.ServeHTTP(rec, req)
					switch rec.Code {
					case http.StatusCreated:
						mu.Lock()
						clientWon++
						mu.Unlock()
						finish()
						return
					case http.StatusConflict, http.StatusBadGateway:
					default:
						report(fmt.Errorf("client: %d %s", rec.Code, rec.Body))
						return
					}
					runtime.Gosched()
				}
			}()
			go func() { // the last attempt, late (in every other round)
				defer wg.Done()
				<-start
				if round%2 == 1 {
					return
				}
				for range mrand.IntN(400) {
					runtime.Gosched()
				}
				gw.charge(key, stale.ChildKey("payment"))
				tx, err := s.Begin(ctx, stale)
				if err != nil {
					report(err)
					return
				}
				if err := s.write(ctx, tx, "order:"+key); err != nil {
					tx.Rollback(ctx)
					report(err)
					return
				}
				switch err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusCreated, Body: []byte("stale")}); {
				case err == nil:
					mu.Lock()
					staleWon++
					mu.Unlock()
				case errors.Is(err, idem.ErrFenced):
				default:
					t.Logf("%s: the stale attempt's Complete: %v", key, err) // a serialization error commits nothing
				}
			}()
			close(start)
			wg.Wait()
			for _, err := range errs {
				t.Errorf("%s: %v", key, err)
			}
			// Drain: the operator and a completer finish the key.
			for i := 0; ; i++ {
				info, err := s.in.InspectKey(ctx, "u", key, budget)
				if err != nil {
					t.Fatalf("%s: InspectKey: %v", key, err)
				}
				if info.State == idemdriver.KeyCompleted {
					if info.Response.Status != http.StatusCreated || !info.CreatedAt.Equal(first.CreatedAt) {
						t.Errorf("%s: completed with %d, operation %v; want 201 of operation %v", key, info.Response.Status, info.CreatedAt, first.CreatedAt)
					}
					break
				}
				if i == 50 {
					t.Fatalf("%s: still %s after the drain", key, info.State)
				}
				if info.State == idemdriver.KeyGivenUp {
					if _, err := s.in.Redrive(ctx, "u", key, budget); err != nil {
						t.Fatalf("%s: Redrive in the drain: %v", key, err)
					}
				}
				if _, err := c1.RunOnce(ctx); err != nil {
					t.Fatal(err)
				}
			}
			if got := s.count(t, "order:"+key); got != 1 {
				t.Errorf("%s: %d orders, want 1", key, got)
			}
			gw.mu.Lock()
			if n := len(gw.byKey[key]); n != 1 {
				t.Errorf("%s: %d payment keys charged, want 1 (one operation)", key, n)
			}
			gw.mu.Unlock()
		}
		mu.Lock()
		defer mu.Unlock()
		if len(overlaps) > 0 {
			t.Errorf("two handlers ran at once on %v", overlaps)
		}
		t.Logf("%d rounds: %d Redrives, the client answered 201 %d times, the stale attempt committed %d", rounds, redriven, clientWon, staleWon)
	})
}
