package storetest

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

// inspectCases are the cases of idemdriver.Inspector; they need Harness.NewAt,
// and skip for a store that is not an idemdriver.Inspector.
var inspectCases = []struct {
	name string
	fn   func(*testing.T, Harness)
}{
	{"InspectStates", testInspectStates},
	{"InspectRedriveRefused", testInspectRedriveRefused},
	{"InspectRedriveCompleter", testInspectRedriveCompleter},
	{"InspectRedriveRace", testInspectRedriveRace},
}

// inspector returns a fresh clocked store as an idemdriver.Inspector, or skips.
func inspector(t *testing.T, h Harness) (idem.Store, idemdriver.Inspector, *Clock) {
	t.Helper()
	s, clk := clocked(t, h)
	in, ok := s.(idemdriver.Inspector)
	if !ok {
		t.Skip("store does not implement idemdriver.Inspector")
	}
	return s, in, clk
}

// giveUp makes (p.User, p.Key) a key the completers gave up on, with the
// budget budget: a client's attempt that failed, then budget re-drives by
// completers (no backoff) that failed. It returns the last re-drive's
// lease, which ended but was never taken over.
func giveUp(t *testing.T, s idem.Store, p idemdriver.ClaimParams, budget int) *idemdriver.Lease {
	t.Helper()
	ctx := context.Background()
	l := mustLease(t, s, p)
	if err := s.Fail(ctx, l); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	for range budget {
		q := p
		q.Owner = idemdriver.NewOwner()
		q.Redrive = &idemdriver.RedriveParams{CreatedAt: l.CreatedAt, Due: idemdriver.AbandonedParams{MaxRedrives: budget}}
		l = mustLease(t, s, q)
		if err := s.Fail(ctx, l); err != nil {
			t.Fatalf("Fail: %v", err)
		}
	}
	return l
}

// infoKeys lists the keys of infos, space-separated, and checks that each
// is in state want at time at.
func infoKeys(t *testing.T, infos []idemdriver.KeyInfo, want idemdriver.KeyState, at time.Time) string {
	t.Helper()
	recs := make([]idemdriver.Record, len(infos))
	for i, in := range infos {
		recs[i] = in.Record
		if in.State != want || !in.At.Equal(at) {
			t.Errorf("ListKeys(%s): %s is %q at %v, want %q at %v", want, in.Key, in.State, in.At, want, at)
		}
	}
	return keys(recs)
}

// testInspectStates: ListKeys lists the keys in each state in its order,
// up to its limit, and InspectKey shows each key's state, by the store's
// clock and the budget asked for.
func testInspectStates(t *testing.T, h Harness) {
	ctx := context.Background()
	s, in, clk := inspector(t, h)
	const budget = 2
	short := func(key string) idemdriver.ClaimParams {
		p := params("u1", key, "fp1")
		p.Lease = time.Second
		return p
	}
	// Completed: c-old, then c-new; c-expired's TTL runs out below.
	for _, k := range []string{"c-old", "c-expired", "c-new"} {
		p := short(k)
		if k == "c-expired" {
			p.TTL = 2 * time.Second
		}
		if err := run(ctx, h, s, mustLease(t, s, p), "inspect-"+k, response(k)); err != nil {
			t.Fatalf("run(%s): %v", k, err)
		}
		clk.Advance(time.Millisecond)
	}
	// Given up: g-1 (lease ended first), then g-2.
	giveUp(t, s, short("g-1"), budget)
	clk.Advance(time.Millisecond)
	giveUp(t, s, short("g-2"), budget)
	clk.Advance(time.Millisecond)
	// Abandoned: a-2 failed before a-1; a-3 was re-driven once, below the
	// budget (it waits for its backoff: still abandoned).
	a2 := mustLease(t, s, short("a-2"))
	if err := s.Fail(ctx, a2); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	clk.Advance(time.Millisecond)
	a1 := mustLease(t, s, short("a-1"))
	if err := s.Fail(ctx, a1); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	clk.Advance(time.Millisecond)
	giveUp(t, s, short("a-3"), 1)
	clk.Advance(time.Millisecond)
	// In flight: f-long (lease ends later) was claimed before f-short.
	long := params("u1", "f-long", "fp1")
	long.Lease = time.Hour
	mustLease(t, s, long)
	clk.Advance(time.Millisecond)
	shortLease := params("u1", "f-short", "fp1")
	shortLease.Lease = time.Minute
	mustLease(t, s, shortLease)
	// Another user's key, in flight: users are listed together.
	other := params("u2", "f-other", "fp1")
	other.Lease = 30 * time.Minute
	mustLease(t, s, other)
	clk.Advance(3 * time.Second) // c-expired's TTL passed; no short lease is live

	now := clk.Now()
	for _, c := range []struct {
		state idemdriver.KeyState
		want  string
	}{
		{idemdriver.KeyInFlight, "f-short f-other f-long"},
		{idemdriver.KeyAbandoned, "a-2 a-1 a-3"},
		{idemdriver.KeyGivenUp, "g-1 g-2"},
		{idemdriver.KeyCompleted, "c-new c-old"},
	} {
		infos, err := in.ListKeys(ctx, idemdriver.ListParams{State: c.state, Limit: 10, MaxRedrives: budget})
		if err != nil {
			t.Fatalf("ListKeys(%s): %v", c.state, err)
		}
		if got := infoKeys(t, infos, c.state, now); got != c.want {
			t.Errorf("ListKeys(%s) = %s, want %s", c.state, got, c.want)
		}
		infos, err = in.ListKeys(ctx, idemdriver.ListParams{State: c.state, Limit: 1, MaxRedrives: budget})
		if first, _, _ := strings.Cut(c.want, " "); err != nil || infoKeys(t, infos, c.state, now) != first {
			t.Errorf("ListKeys(%s, limit 1) = %s, %v; want %s", c.state, infoKeys(t, infos, c.state, now), err, first)
		}
		if infos, err := in.ListKeys(ctx, idemdriver.ListParams{State: c.state, Limit: 0, MaxRedrives: budget}); err != nil || len(infos) != 0 {
			t.Errorf("ListKeys(%s, limit 0) = %d keys, %v; want none", c.state, len(infos), err)
		}
	}
	if _, err := in.ListKeys(ctx, idemdriver.ListParams{State: "stuck", Limit: 10}); err == nil {
		t.Errorf("ListKeys of an unknown state: no error")
	}
	// A larger budget: the given-up keys are the completers' again. The
	// default (0) is DefaultCompleterMaxAttempts.
	for _, b := range []int{budget + 1, 0} {
		infos, err := in.ListKeys(ctx, idemdriver.ListParams{State: idemdriver.KeyAbandoned, Limit: 10, MaxRedrives: b})
		if got := infoKeys(t, infos, idemdriver.KeyAbandoned, now); err != nil || got != "g-1 g-2 a-2 a-1 a-3" {
			t.Errorf("ListKeys(abandoned, budget %d) = %s, %v; want g-1 g-2 a-2 a-1 a-3", b, got, err)
		}
		if infos, err := in.ListKeys(ctx, idemdriver.ListParams{State: idemdriver.KeyGivenUp, Limit: 10, MaxRedrives: b}); err != nil || len(infos) != 0 {
			t.Errorf("ListKeys(given-up, budget %d) = %d keys, %v; want none", b, len(infos), err)
		}
	}

	for _, c := range []struct {
		user, key          string
		state              idemdriver.KeyState
		attempts, redrives int
	}{
		{"u1", "f-short", idemdriver.KeyInFlight, 1, 0},
		{"u2", "f-other", idemdriver.KeyInFlight, 1, 0},
		{"u1", "a-1", idemdriver.KeyAbandoned, 1, 0},
		{"u1", "a-3", idemdriver.KeyAbandoned, 2, 1},
		{"u1", "g-2", idemdriver.KeyGivenUp, 3, 2},
		{"u1", "c-new", idemdriver.KeyCompleted, 1, 0},
	} {
		info, err := in.InspectKey(ctx, c.user, c.key, budget)
		if err != nil {
			t.Errorf("InspectKey(%s): %v", c.key, err)
			continue
		}
		if info.State != c.state || !info.At.Equal(now) || info.User != c.user || info.Key != c.key ||
			info.Attempts != c.attempts || info.Redrives != c.redrives || info.Fingerprint != "fp1" ||
			info.Method != http.MethodPost || info.Path != "/v1/things" {
			t.Errorf("InspectKey(%s) = %q at %v, %+v; want %q at %v, %d attempts, %d re-drives, the stored request",
				c.key, info.State, info.At, info.Record, c.state, now, c.attempts, c.redrives)
		}
		if (c.state == idemdriver.KeyCompleted) != (info.Response != nil && !info.CompletedAt.IsZero()) {
			t.Errorf("InspectKey(%s): response %v, completed at %v", c.key, info.Response, info.CompletedAt)
		}
	}
	if info, err := in.InspectKey(ctx, "u1", "c-new", budget); err == nil {
		sameResponse(t, info.Response, response("c-new"))
	}
	if info, err := in.InspectKey(ctx, "u1", "g-2", budget+1); err != nil || info.State != idemdriver.KeyAbandoned {
		t.Errorf("InspectKey(g-2, budget %d) = %+v, %v; want abandoned", budget+1, info, err)
	}
	for _, k := range []string{"c-expired", "none"} {
		if info, err := in.InspectKey(ctx, "u1", k, budget); !errors.Is(err, idem.ErrNotFound) {
			t.Errorf("InspectKey(%s) = %+v, %v; want ErrNotFound", k, info, err)
		}
	}
	if info, err := in.InspectKey(ctx, "u2", "f-short", budget); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("InspectKey of another user's key = %+v, %v; want ErrNotFound", info, err)
	}
}

// testInspectRedriveRefused: Redrive refuses a key that is not given up,
// and changes nothing then.
func testInspectRedriveRefused(t *testing.T, h Harness) {
	ctx := context.Background()
	s, in, clk := inspector(t, h)
	const budget = 2
	done := params("u1", "r-done", "fp1")
	if err := run(ctx, h, s, mustLease(t, s, done), "inspect-r-done", response("done")); err != nil {
		t.Fatalf("run: %v", err)
	}
	expired := params("u1", "r-expired", "fp1")
	expired.TTL = time.Second
	if err := run(ctx, h, s, mustLease(t, s, expired), "inspect-r-expired", response("expired")); err != nil {
		t.Fatalf("run: %v", err)
	}
	mustLease(t, s, params("u1", "r-flight", "fp1")) // a 10s lease
	giveUp(t, s, params("u1", "r-once", "fp1"), 1)   // 1 re-drive: abandoned for a budget of 2
	// Given up, then taken over by its client's retry: in flight.
	giveUp(t, s, params("u1", "r-retried", "fp1"), budget)
	retried := mustLease(t, s, params("u1", "r-retried", "fp1"))
	clk.Advance(2 * time.Second)

	for _, c := range []struct {
		key   string
		want  error
		state idemdriver.KeyState
	}{
		{"r-done", idemdriver.ErrNotGivenUp, idemdriver.KeyCompleted},
		{"r-flight", idemdriver.ErrNotGivenUp, idemdriver.KeyInFlight},
		{"r-once", idemdriver.ErrNotGivenUp, idemdriver.KeyAbandoned},
		{"r-retried", idemdriver.ErrNotGivenUp, idemdriver.KeyInFlight},
		{"r-expired", idem.ErrNotFound, ""},
		{"r-none", idem.ErrNotFound, ""},
	} {
		before, _ := s.Get(ctx, "u1", c.key)
		n, err := in.Redrive(ctx, "u1", c.key, budget)
		if !errors.Is(err, c.want) || n != 0 {
			t.Errorf("Redrive(%s) = %d, %v; want 0, %v", c.key, n, err, c.want)
		}
		var ng *idemdriver.NotGivenUpError
		if c.state != "" && (!errors.As(err, &ng) || ng.State != c.state) {
			t.Errorf("Redrive(%s) = %v; want a NotGivenUpError naming %s", c.key, err, c.state)
		}
		after, _ := s.Get(ctx, "u1", c.key)
		if (before == nil) != (after == nil) || before != nil && (before.Redrives != after.Redrives ||
			before.Owner != after.Owner || !before.LeaseUntil.Equal(after.LeaseUntil) || before.Attempts != after.Attempts) {
			t.Errorf("Redrive(%s) refused, yet the record changed: %+v, then %+v", c.key, before, after)
		}
	}
	// The retried key is still its client's to finish.
	if err := run(ctx, h, s, retried, "inspect-r-retried", response("retried")); err != nil {
		t.Errorf("the client's retry after a refused Redrive: %v", err)
	}
}

// testInspectRedriveCompleter: a completer gives a key up; Redrive hands
// it back, changing nothing but the count of re-drives; the completer then
// re-drives it to completion, once.
func testInspectRedriveCompleter(t *testing.T, h Harness) {
	ctx := context.Background()
	s, in, clk := inspector(t, h)
	const budget = 2
	var failing atomic.Bool
	failing.Store(true)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if failing.Load() {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		tx, err := idem.TxFromContext(r.Context())
		if err == nil {
			err = h.Write(r.Context(), tx, "inspect-completer")
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{"id":"1"}`))
	})
	ss, ok := s.(idemdriver.SweepingStore)
	if !ok {
		t.Fatalf("%T does not implement idemdriver.Sweeper", s)
	}
	c := idem.NewCompleter(ss, handler, idem.CompleterOptions{
		MaxAttempts: budget, Backoff: time.Second, MaxBackoff: time.Minute, Interval: time.Hour,
		Middleware: idem.Options{Lease: 10 * time.Second, TTL: time.Hour},
		Logger:     slog.New(slog.DiscardHandler),
	})
	scan := func(want idem.CompleterStats) {
		t.Helper()
		st, err := c.RunOnce(ctx)
		if err != nil || st != want {
			t.Fatalf("RunOnce = %+v, %v; want %+v", st, err, want)
		}
	}
	p := params("u1", "k-given-up", "fp1")
	first := mustLease(t, s, p)
	if err := s.Fail(ctx, first); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	scan(idem.CompleterStats{Scanned: 1, Failed: 1})
	clk.Advance(time.Second)
	scan(idem.CompleterStats{Scanned: 1, Failed: 1, GivenUp: 1})
	clk.Advance(2 * time.Minute) // past the longest backoff: nothing is due
	scan(idem.CompleterStats{})

	before, err := in.InspectKey(ctx, p.User, p.Key, budget)
	if err != nil || before.State != idemdriver.KeyGivenUp || before.Attempts != 3 || before.Redrives != budget {
		t.Fatalf("InspectKey = %+v, %v; want given up after 3 attempts, 2 re-drives", before, err)
	}
	infos, err := in.ListKeys(ctx, idemdriver.ListParams{State: idemdriver.KeyGivenUp, Limit: 10, MaxRedrives: budget})
	if err != nil || len(infos) != 1 || infos[0].Key != p.Key {
		t.Fatalf("ListKeys(given-up) = %d keys, %v; want %s", len(infos), err, p.Key)
	}
	n, err := in.Redrive(ctx, p.User, p.Key, budget)
	if err != nil || n != budget {
		t.Fatalf("Redrive = %d, %v; want %d", n, err, budget)
	}
	after, err := in.InspectKey(ctx, p.User, p.Key, budget)
	if err != nil || after.State != idemdriver.KeyAbandoned || after.Redrives != 0 {
		t.Fatalf("InspectKey after Redrive = %+v, %v; want abandoned, no re-drives", after, err)
	}
	if after.Owner != before.Owner || !after.LeaseUntil.Equal(before.LeaseUntil) || after.Fingerprint != before.Fingerprint ||
		!after.CreatedAt.Equal(before.CreatedAt) || !after.ExpiresAt.Equal(before.ExpiresAt) || after.Attempts != before.Attempts {
		t.Errorf("Redrive changed more than the re-drives:\nbefore %+v\nafter  %+v", before.Record, after.Record)
	}
	if _, err := in.Redrive(ctx, p.User, p.Key, budget); !errors.Is(err, idemdriver.ErrNotGivenUp) {
		t.Errorf("second Redrive: %v, want ErrNotGivenUp", err)
	}
	sw := s.(idemdriver.Sweeper)
	due, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10, MaxRedrives: budget, Backoff: time.Second, MaxBackoff: time.Minute})
	if err != nil || keys(due) != p.Key {
		t.Errorf("Abandoned after Redrive = %s, %v; want %s, due at once", keys(due), err, p.Key)
	}
	if got := count(t, h, s, "inspect-completer"); got != 0 {
		t.Fatalf("effects before the gateway works = %d, want 0", got)
	}
	failing.Store(false)
	scan(idem.CompleterStats{Scanned: 1, Completed: 1})
	clk.Advance(2 * time.Minute)
	scan(idem.CompleterStats{})
	if got := count(t, h, s, "inspect-completer"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
	done, err := in.InspectKey(ctx, p.User, p.Key, budget)
	if err != nil || done.State != idemdriver.KeyCompleted || done.Attempts != 4 || done.Redrives != 1 ||
		done.Response == nil || done.Response.Status != http.StatusCreated || !done.CreatedAt.Equal(first.CreatedAt) {
		t.Errorf("InspectKey once re-driven = %+v, %v; want completed (201), 4 attempts, 1 re-drive, the same operation", done, err)
	}
	cl, err := s.Claim(ctx, p)
	if err != nil || cl.Response == nil || cl.Response.Status != http.StatusCreated {
		t.Errorf("client's retry = %+v, %v; want the stored 201", cl, err)
	}
}

// testInspectRedriveRace: Redrive racing completers' claims, a client's
// retry and the late commit of the last attempt (whose lease ended but was
// never taken over) never lets a key run twice: at most one lease is
// handed out and at most one outcome commits, with its effect.
func testInspectRedriveRace(t *testing.T, h Harness) {
	ctx := context.Background()
	s, in, _ := inspector(t, h)
	const (
		budget     = 2
		keysN      = 8
		completers = 4
	)
	raced := 0 // keys whose Redrive came before the other contenders
	for i := range keysN {
		p := params("u1", fmt.Sprintf("race-%d", i), "fp1")
		stale := giveUp(t, s, p, budget)
		name := "inspect-race-" + p.Key
		var (
			wg              sync.WaitGroup
			leases, commits atomic.Int64
			redriven        atomic.Bool
			mu              sync.Mutex
			errs            []error
			start           = make(chan struct{})
			report          = func(err error) { mu.Lock(); errs = append(errs, err); mu.Unlock() }
			runLease        = func(l *idemdriver.Lease, body string) {
				err := run(ctx, h, s, l, name, response(body))
				switch {
				case err == nil:
					commits.Add(1)
				case !errors.Is(err, idem.ErrFenced):
					// Under a stricter isolation a concurrent write to the
					// record (Redrive's) fails the commit with a
					// serialization error: nothing committed, which the
					// checks below hold to.
					t.Logf("%s: %s's run: %v", p.Key, body, err)
				}
			}
		)
		claim := func(q idemdriver.ClaimParams, who string) {
			defer wg.Done()
			<-start
			c, err := s.Claim(ctx, q)
			switch {
			case err == nil && c.Lease != nil:
				leases.Add(1)
				runLease(c.Lease, who)
			case err == nil && c.Response != nil, errors.Is(err, idem.ErrInFlight), errors.Is(err, idem.ErrNotDue):
			default:
				report(fmt.Errorf("%s: %s's claim: %+v, %w", p.Key, who, c, err))
			}
		}
		for j := range completers {
			q := p
			q.Owner = idemdriver.NewOwner()
			q.Redrive = &idemdriver.RedriveParams{CreatedAt: stale.CreatedAt, Due: idemdriver.AbandonedParams{MaxRedrives: budget}}
			wg.Add(1)
			go claim(q, fmt.Sprintf("completer-%d", j))
		}
		wg.Add(3)
		go claim(p, "client")
		go func() {
			defer wg.Done()
			<-start
			runLease(stale, "stale")
		}()
		go func() {
			defer wg.Done()
			<-start
			n, err := in.Redrive(ctx, p.User, p.Key, budget)
			switch {
			case err == nil && n == budget:
				redriven.Store(true)
			case errors.Is(err, idemdriver.ErrNotGivenUp):
				// The client's retry or the late commit came first.
			default:
				report(fmt.Errorf("%s: Redrive = %d, %w", p.Key, n, err))
			}
		}()
		close(start)
		wg.Wait()
		for _, err := range errs {
			t.Error(err)
		}
		// The last attempt commits unless a takeover fenced it, and then
		// the takeover, whose lease is live, commits: one outcome (none
		// only when a commit failed on a serialization error, see above).
		if leases.Load() > 1 || commits.Load() > 1 {
			t.Errorf("%s: %d leases handed out, %d outcomes committed; want at most one each", p.Key, leases.Load(), commits.Load())
		}
		if got := count(t, h, s, name); int64(got) != commits.Load() {
			t.Errorf("%s: %d effects, %d commits", p.Key, got, commits.Load())
		}
		if rec, err := s.Get(ctx, p.User, p.Key); err != nil || (rec.Response != nil) != (commits.Load() == 1) {
			t.Errorf("%s: Get = %+v, %v; want a response exactly when an outcome committed (%d)", p.Key, rec, err, commits.Load())
		}
		if redriven.Load() {
			raced++
		}
	}
	t.Logf("Redrive came first for %d of %d keys", raced, keysN)
}
