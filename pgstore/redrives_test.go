package pgstore_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/pgstore"
)

// get reads (user, key), which must exist.
func get(t *testing.T, s *pgstore.Store, user, key string) *idemdriver.Record {
	t.Helper()
	rec, err := s.Get(context.Background(), user, key)
	if err != nil {
		t.Fatalf("Get(%s/%s): %v", user, key, err)
	}
	return rec
}

// TestRedrivesCounted: a completer's takeover (ClaimParams.Redrive) counts
// in Redrives, in the same statement as the attempt; a client's takeover
// and a resend with the same owner do not; a completer's claim never
// replaces an expired completed record nor claims a new key (ErrNotDue,
// nothing changed); replacing an expired completed record starts again
// from zero.
func TestRedrivesCounted(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	p := params("u1", "k1", "fp1")
	p.Lease, p.TTL = time.Second, time.Hour

	want := func(step string, attempts, redrives int) {
		t.Helper()
		rec := get(t, s, p.User, p.Key)
		if rec.Attempts != attempts || rec.Redrives != redrives {
			t.Errorf("%s: attempts %d, redrives %d; want %d, %d", step, rec.Attempts, rec.Redrives, attempts, redrives)
		}
	}
	claim := func(step string, redrive bool, owner string) *idemdriver.Lease {
		t.Helper()
		q := p
		q.Owner = owner
		if redrive {
			q.Redrive = &idemdriver.RedriveParams{CreatedAt: get(t, s, p.User, p.Key).CreatedAt}
		}
		return lease(t, s, q)
	}

	claim("client", false, idemdriver.NewOwner())
	want("new key", 1, 0)

	b.clock.Advance(2 * time.Second)
	claim("client takeover", false, idemdriver.NewOwner())
	want("client takeover", 2, 0)

	b.clock.Advance(2 * time.Second)
	owner := idemdriver.NewOwner()
	first := claim("redrive", true, owner)
	want("completer takeover", 3, 1)

	again := claim("redrive resent", true, owner)
	if *again != *first {
		t.Errorf("resent redrive = %+v, want the first lease %+v", again, first)
	}
	want("completer resend", 3, 1)

	b.clock.Advance(2 * time.Second)
	l := claim("redrive 2", true, idemdriver.NewOwner())
	want("second completer takeover", 4, 2)

	// Fail ends the lease; a client takes over at once, not counted.
	if err := s.Fail(ctx, l); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	l = claim("client after fail", false, idemdriver.NewOwner())
	want("client takeover after Fail", 5, 2)

	// Completed and expired: a completer's claim does not replace it; a
	// client's does, as a new operation.
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if err := tx.Complete(ctx, response("done")); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	b.clock.Advance(2 * time.Hour)
	q := p
	q.Owner, q.Redrive = idemdriver.NewOwner(), &idemdriver.RedriveParams{CreatedAt: l.CreatedAt}
	if c, err := s.Claim(ctx, q); !errors.Is(err, idem.ErrNotDue) {
		t.Errorf("completer's claim of an expired completed record = %+v, %v; want ErrNotDue", c, err)
	}
	if rec, err := s.Get(ctx, p.User, p.Key); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("after a completer's claim of an expired record: Get = %+v, %v; want it unchanged (expired)", rec, err)
	}
	claim("replace", false, idemdriver.NewOwner())
	want("replaced by a client's claim", 1, 0)

	// A completer never claims a new key.
	q = params("u1", "k2", "fp1")
	q.Redrive = &idemdriver.RedriveParams{CreatedAt: l.CreatedAt}
	if c, err := s.Claim(ctx, q); !errors.Is(err, idem.ErrNotDue) {
		t.Errorf("completer's claim of a new key = %+v, %v; want ErrNotDue", c, err)
	}
	if rec, err := s.Get(ctx, "u1", "k2"); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("after a completer's claim of a new key: Get = %+v, %v; want ErrNotFound", rec, err)
	}
}

// TestAbandonedDue: Abandoned lists exactly the records that
// idemdriver.AbandonedParams.Due accepts at the store's clock, by lease end, then
// creation, user and key; given-up keys and keys in their backoff are left
// out, however early their lease ended, and never take the limit's places.
func TestAbandonedDue(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	t0 := b.clock.Now()

	// Each key's lease ends leaseEnd after t0 (records created in this
	// order, one second apart), with the given re-drives.
	type key struct {
		name     string
		leaseEnd time.Duration
		redrives int
	}
	ks := []key{
		{"given-up", 0, 6},         // MaxRedrives 6: never listed
		{"backoff-max", 0, 5},      // capped at 40s
		{"r2", 1 * time.Second, 2}, // 20s after its lease
		{"r1", 2 * time.Second, 1}, // 10s
		{"fresh", 3 * time.Second, 0},
		{"fresh-tie-b", 5 * time.Second, 0}, // same lease end as fresh-tie-a,
		{"fresh-tie-a", 5 * time.Second, 0}, // created later: listed after
		{"huge", 0, 1 << 30},                // given up; uncapped it would overflow
		{"live", time.Hour, 0},
		{"done", 0, 0}, // completed: never listed
	}
	for i, k := range ks {
		p := params("u", k.name, "fp")
		l := lease(t, s, p)
		if k.name == "done" {
			tx, err := s.Begin(ctx, l)
			if err != nil {
				t.Fatal(err)
			}
			if err := tx.Complete(ctx, response("ok")); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := b.pool.Exec(ctx, `UPDATE idempotency_keys SET redrives = $1, lease_until = $2, created_at = $3 WHERE key = $4`,
			k.redrives, t0.Add(k.leaseEnd), t0.Add(time.Duration(i)*time.Second-time.Hour), k.name); err != nil {
			t.Fatal(err)
		}
	}
	// fresh-tie-a was created after fresh-tie-b; the tie on lease end is
	// broken by creation, not by key.
	p := idemdriver.AbandonedParams{Limit: 100, MaxRedrives: 6, Backoff: 10 * time.Second, MaxBackoff: 40 * time.Second}

	list := func(p idemdriver.AbandonedParams) []string {
		t.Helper()
		recs, err := s.Abandoned(ctx, p)
		if err != nil {
			t.Fatalf("Abandoned(%+v) at %v: %v", p, b.clock.Now().Sub(t0), err)
		}
		var names []string
		for _, r := range recs {
			names = append(names, r.Key)
		}
		return names
	}
	// expect is Due applied to every record, in the documented order.
	expect := func(p idemdriver.AbandonedParams) []string {
		t.Helper()
		var recs []*idemdriver.Record
		for _, k := range ks {
			if r := get(t, s, "u", k.name); p.Due(r, b.clock.Now()) {
				recs = append(recs, r)
			}
		}
		slices.SortStableFunc(recs, func(a, b *idemdriver.Record) int {
			if c := a.LeaseUntil.Compare(b.LeaseUntil); c != 0 {
				return c
			}
			if c := a.CreatedAt.Compare(b.CreatedAt); c != 0 {
				return c
			}
			return strings.Compare(a.Key, b.Key)
		})
		var names []string
		for _, r := range recs {
			names = append(names, r.Key)
		}
		if len(names) > max(p.Limit, 0) {
			names = names[:max(p.Limit, 0)]
		}
		return names
	}

	steps := []struct {
		at   time.Duration
		want []string
	}{
		{0, nil},
		{3 * time.Second, []string{"fresh"}},
		{5 * time.Second, []string{"fresh", "fresh-tie-b", "fresh-tie-a"}},
		{12*time.Second - time.Microsecond, []string{"fresh", "fresh-tie-b", "fresh-tie-a"}},
		{12 * time.Second, []string{"r1", "fresh", "fresh-tie-b", "fresh-tie-a"}}, // exactly at the end of r1's backoff
		{21 * time.Second, []string{"r2", "r1", "fresh", "fresh-tie-b", "fresh-tie-a"}},
		{40 * time.Second, []string{"backoff-max", "r2", "r1", "fresh", "fresh-tie-b", "fresh-tie-a"}},
	}
	for _, st := range steps {
		b.clock.Advance(t0.Add(st.at).Sub(b.clock.Now()))
		if got := list(p); !slices.Equal(got, st.want) {
			t.Errorf("at t0+%v: Abandoned = %v, want %v", st.at, got, st.want)
		}
		if got, want := list(p), expect(p); !slices.Equal(got, want) {
			t.Errorf("at t0+%v: Abandoned = %v, Due says %v", st.at, got, want)
		}
		// The limit takes the first due keys: the ones left out never
		// occupy its places.
		q := p
		q.Limit = 2
		if got, want := list(q), expect(q); !slices.Equal(got, want) {
			t.Errorf("at t0+%v, limit 2: Abandoned = %v, want %v", st.at, got, want)
		}
	}

	// Other parameters, against Due: no budget, no cap (2^(2^30) would
	// overflow anything: it waits, and the statement does not fail), no
	// backoff, and a sub-microsecond backoff, which still waits.
	b.clock.Advance(time.Hour)
	for _, q := range []idemdriver.AbandonedParams{
		{Limit: 100, Backoff: 10 * time.Second, MaxBackoff: 40 * time.Second},
		{Limit: 100, MaxRedrives: 4},
		{Limit: 100, MaxRedrives: 7, Backoff: 10 * time.Second, MaxBackoff: 40 * time.Second},
		{Limit: 100, MaxRedrives: 6, Backoff: 10 * time.Minute},
		{Limit: 100, MaxRedrives: 6, Backoff: time.Nanosecond},
		{Limit: 100, MaxRedrives: 6, Backoff: 20 * time.Minute, MaxBackoff: 10 * time.Minute},
		{Limit: 0},
		{Limit: -1},
	} {
		if got, want := list(q), expect(q); !slices.Equal(got, want) {
			t.Errorf("%+v: Abandoned = %v, Due says %v", q, got, want)
		}
	}
	// Uncapped, the record with 2^30 re-drives waits for ever; Due's
	// doubling would overflow, so it is checked on its own.
	if got := list(idemdriver.AbandonedParams{Limit: 100, Backoff: time.Second}); slices.Contains(got, "huge") {
		t.Errorf("uncapped backoff after 2^30 re-drives: Abandoned = %v, want huge left out", got)
	}
	if got := list(idemdriver.AbandonedParams{Limit: 100, Backoff: time.Second, MaxBackoff: time.Minute}); !slices.Contains(got, "huge") {
		t.Errorf("capped backoff after 2^30 re-drives, an hour later: Abandoned = %v, want huge", got)
	}
	b.clock.Advance(-time.Hour)
	if got := list(idemdriver.AbandonedParams{Limit: 100, Backoff: time.Nanosecond}); slices.Contains(got, "r1") != true {
		t.Errorf("1ns backoff: Abandoned = %v, want r1 (its lease ended 38s ago)", got)
	}
	b.clock.Advance(t0.Add(2 * time.Second).Sub(b.clock.Now())) // r1's lease end exactly
	if got := list(idemdriver.AbandonedParams{Limit: 100, Backoff: time.Nanosecond}); slices.Contains(got, "r1") {
		t.Errorf("1ns backoff, at the lease's end: Abandoned = %v, want r1 waiting", got)
	}
}

// TestAbandonedUsesPartialIndex: the completer's query reads the partial
// index of records without a response, in its order (no sort), whatever
// the number of completed records.
func TestAbandonedUsesPartialIndex(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	// 20000 completed records, 500 without a response.
	if _, err := b.pool.Exec(ctx, `
INSERT INTO idempotency_keys
	(user_id, key, fingerprint, method, path, owner, lease_until, attempts, redrives,
	 response_status, created_at, completed_at, expires_at)
SELECT 'u', 'k' || i, 'fp', 'POST', '/', 'o' || i, now() - i * interval '1 second', 1, (i / 40) % 4,
	CASE WHEN i % 40 = 0 THEN NULL ELSE 201 END, now() - interval '1 day', now(), now() + interval '1 day'
FROM generate_series(1, 20000) i`); err != nil {
		t.Fatal(err)
	}
	if _, err := b.pool.Exec(ctx, `ANALYZE idempotency_keys`); err != nil {
		t.Fatal(err)
	}
	var plan []map[string]any
	if err := b.pool.QueryRow(ctx, `EXPLAIN (FORMAT JSON) `+pgstore.AbandonedSQL,
		nil, 3, int64(time.Second), int64(time.Minute), 100, true, []string{"orders.receipt"}).Scan(&plan); err != nil {
		t.Fatalf("EXPLAIN: %v", err)
	}
	js, _ := json.Marshal(plan)
	var nodes []string
	var walk func(n map[string]any)
	walk = func(n map[string]any) {
		nodes = append(nodes, fmt.Sprintf("%v %v", n["Node Type"], n["Index Name"]))
		children, _ := n["Plans"].([]any)
		for _, c := range children {
			walk(c.(map[string]any))
		}
	}
	for _, top := range plan {
		walk(top["Plan"].(map[string]any))
	}
	t.Logf("plan: %v", nodes)
	if !slices.ContainsFunc(nodes, func(n string) bool {
		return strings.HasSuffix(n, " idempotency_keys_abandoned_order_idx") && strings.HasPrefix(n, "Index")
	}) {
		t.Errorf("plan does not scan idempotency_keys_abandoned_order_idx: %v\n%s", nodes, js)
	}
	if slices.ContainsFunc(nodes, func(n string) bool {
		return strings.Contains(n, "Sort") || strings.HasPrefix(n, "Seq Scan")
	}) {
		t.Errorf("plan sorts or reads the whole table: %v\n%s", nodes, js)
	}

	// And it answers: of the 500 records without a response, the 125 with
	// 3 re-drives are given up; the others are due, by lease end.
	recs, err := s.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 1000, MaxRedrives: 3, Backoff: time.Second, MaxBackoff: time.Minute})
	if err != nil {
		t.Fatalf("Abandoned: %v", err)
	}
	if len(recs) != 375 {
		t.Errorf("Abandoned = %d records, want 375", len(recs))
	}
	for i, r := range recs {
		if r.Redrives >= 3 || r.Response != nil || (i > 0 && r.LeaseUntil.Before(recs[i-1].LeaseUntil)) {
			t.Fatalf("Abandoned[%d] = %s, redrives %d, lease end %v after %v", i, r.Key, r.Redrives, r.LeaseUntil, recs[max(i-1, 0)].LeaseUntil)
		}
	}
}
