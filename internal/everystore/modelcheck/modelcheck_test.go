// The model checker of the idempotency protocol (issue 10, point 1).
//
// # Model
//
// Each check (one rapid test case) builds a fresh store of one kind
// (memstore; sqlitestore on a temp file; pgstore on a schema of its own;
// redisfront, with a key prefix of its own, in front of pgstore, its Redis
// reached through an in-process toxiproxy proxy), with a fake clock
// (storetest.Clock, given to the store's Options.Now, and to redisfront's)
// that moves only in the model's steps. The real idem.Middleware and
// idem.NewCompleter run over the store wrapped by mcFaultStore, which can
// fail the next call of any store method (Claim, Begin, Tx.Complete,
// Release, Fail, Abandoned, DeleteExpired) "before" (an error, the inner
// store not called) or "after" (the inner store called, its answer
// replaced by an error). The handler behind them (mcEnv.handle) follows a
// plan per request: refuse (400) before anything; or charge a fake
// in-process gateway by the derived key (Lease.ChildKey("charge"), one
// payment per key) and then fail (500), panic, or write one execution row
// in the request's own transaction (memstore.FromContext's OnCommit,
// sqlitestore.FromContext, pgstore.FromContext) and answer 201 with
// Content-Type, Location, Set-Cookie and X-Mc-Attempt. A plan may hold the
// handler (before or after its charge, never inside a transaction) until
// the model releases it with its final outcome. Keys: 2 users x 3 keys,
// two bodies (variants) and a second spelling of the first.
//
// # Steps (drawn by rapid)
//
// request (a new or repeated request, random key, variant and outcome),
// retry_same (a key used before, same body, maybe spelt otherwise),
// retry_other (a key used before, the other body), concurrent (2 to 4
// goroutines with the same key at once, each its own outcome, sometimes
// one of them with the other body, sometimes a completer scan racing
// them),
// hold (a request whose handler blocks), release (a held handler goes on:
// it commits if it still owns the key, and is fenced if it was taken
// over), advance (the clock moves 1s..29s, past the lease, or past the
// TTL), completer (one RunOnce with a random re-drive outcome), drain (the
// completer run until no key is left abandoned, re-drives succeeding),
// gc (DeleteExpired); for redisfront also redis_flush (only our prefix's
// keys), redis_down and redis_up (the proxy stopped and started). The
// request-like steps arm at most one injected fault for the step.
//
// # Oracle (after every step, and for every answer)
//
//   - At most one committed execution per operation (user, key, record
//     creation time, named by its derived key), and each has its charge.
//   - Every answer is the one the contract gives for the key's state before
//     the step, read from the store: a completed key with the same body
//     replays, byte for byte, the status, body, Content-Type and Location of
//     its committed execution, with Idempotent-Replayed and without
//     Set-Cookie or other headers; another body gets 422; a live lease gets
//     409; a free, expired or abandoned key is claimed (a takeover keeps the
//     operation: same creation time, next attempt) and answers its own
//     handler's outcome: 201 whose execution committed, 400, 500, or 503
//     only when Tx.Complete had an injected fault. A released held handler
//     that lost its key to a takeover is fenced (409) and commits nothing.
//     Every answer echoes its Idempotency-Key.
//   - A completed record holds exactly its execution's answer; a record
//     without an answer has no committed execution; a payment without its
//     execution always has a record without an answer (so the completer
//     can finish it).
//   - After drain (no held handler owns a live lease, no fault armed): no
//     abandoned key is left and every charge has its committed execution.
//
// After an injected fault the model accepts a 503 (the outcome is then
// unknown to the client, and the store's state decides), never a second
// execution. With Redis, a 409 where the store would decide otherwise is
// accepted within LockTTL (real time) of a Redis error or outage, as
// redisfront documents: a lease lock whose removal was lost misleads for
// LockTTL at most.
//
// Each test logs what its checks saw (answers by kind, classes, takeovers,
// faults fired, releases owned or fenced, completer outcomes). The
// regression scripts (regress_test.go) replay fixed sequences of the same
// steps on every store. IDEM_MODELCHECK_MUTANT names a deliberate bug of
// the test's own wrapper or handler (see env_test.go), to watch the oracle
// fail.
//
// A short run is the default; -modelcheck.checks=N (or
// IDEM_MODELCHECK_CHECKS=N) sets the number of checks per store for a
// long run, and -rapid.steps the mean number of steps per check.
package modelcheck

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/redis/go-redis/v9"
	"pgregory.net/rapid"
)

// mcDefaultChecks is the short run's number of checks per store.
const mcDefaultChecks = 12

var mcChecksFlag = flag.Int("modelcheck.checks", 0, "checks per store of the protocol model (default: IDEM_MODELCHECK_CHECKS, else a short run)")

// TestMain sets rapid's number of checks from -modelcheck.checks or
// IDEM_MODELCHECK_CHECKS, unless -rapid.checks was given.
func TestMain(m *testing.M) {
	flag.Parse()
	checks := mcDefaultChecks
	if v := os.Getenv("IDEM_MODELCHECK_CHECKS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			fmt.Fprintf(os.Stderr, "IDEM_MODELCHECK_CHECKS=%q: want a positive number\n", v)
			os.Exit(2)
		}
		checks = n
	}
	if *mcChecksFlag > 0 {
		checks = *mcChecksFlag
	}
	explicit := false
	flag.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "rapid.checks" })
	redis.SetLogger(mcQuietLogger{}) // the proxy's outages are on purpose
	if !explicit {
		if err := flag.Set("rapid.checks", strconv.Itoa(checks)); err != nil {
			panic(err)
		}
	}
	os.Exit(m.Run())
}

func TestModelMemstore(t *testing.T)   { t.Parallel(); mcRun(t, mcMem) }
func TestModelSQLite(t *testing.T)     { t.Parallel(); mcRun(t, mcSQLite) }
func TestModelPostgres(t *testing.T)   { t.Parallel(); mcRun(t, mcPG) }
func TestModelRedisFront(t *testing.T) { t.Parallel(); mcRun(t, mcRedis) }

func mcRun(t *testing.T, kind mcKind) {
	fx := mcNewFixture(t, kind)
	start := time.Now()
	var checks, steps int
	rapid.Check(t, func(rt *rapid.T) {
		e := fx.newEnv(rt)
		m := &mcModel{e: e}
		defer m.teardown()
		rt.Repeat(m.actions())
		m.finish(rt)
		checks++
		steps += m.step
	})
	t.Logf("%s: %d checks, %d steps, %v; seen:%s", kind, checks, steps, time.Since(start).Round(time.Millisecond), fx.summary())
}

type mcQuietLogger struct{}

func (mcQuietLogger) Printf(context.Context, string, ...any) {}

// mcHeld is a request whose handler is blocked.
type mcHeld struct {
	user, key string
	variant   int
	plan      *mcPlan
	done      chan *httptest.ResponseRecorder
}

type mcModel struct {
	e    *mcEnv
	step int
	held []*mcHeld
	used map[[2]string]int // (user, key) -> last variant sent

	redisDown    bool
	redisTrouble time.Time // real time of the last Redis outage or error seen
	redisErrors  int64
}

// The classes of a request against the key's state before it.
type mcClass int

const (
	mcClaimNew      mcClass = iota // free, or completed and expired: a new operation
	mcClaimTakeover                // no answer, lease over, same body: the same operation
	mcReplay                       // completed, same body
	mcMismatch                     // bound to the other body
	mcInFlight                     // no answer, lease live, same body
)

func (c mcClass) String() string {
	return [...]string{"claim-new", "takeover", "replay", "mismatch", "in-flight"}[c]
}

func (m *mcModel) actions() map[string]func(*rapid.T) {
	a := map[string]func(*rapid.T){
		"":            m.check,
		"request":     m.request,
		"retry_same":  m.retrySame,
		"retry_other": m.retryOther,
		"concurrent":  m.concurrent,
		"hold":        m.hold,
		"release":     m.release,
		"advance":     m.advance,
		"completer":   m.completer,
		"drain":       func(t *rapid.T) { m.begin(t, "drain"); m.drain(t) },
		"gc":          m.gc,
	}
	if m.e.fx.kind == mcRedis {
		a["redis_flush"] = m.redisFlush
		a["redis_down"] = m.redisDownStep
		a["redis_up"] = m.redisUpStep
	}
	return a
}

func (m *mcModel) begin(t *rapid.T, format string, args ...any) {
	m.step++
	t.Logf("step %d [clock +%v]: %s", m.step, m.e.clock.Now().Sub(time.Date(2030, 1, 1, 12, 0, 0, 0, time.UTC)), fmt.Sprintf(format, args...))
}

var (
	mcOutcomeGen = rapid.SampledFrom([]mcOutcome{mcOK, mcOK, mcOK, mcRefuse, mcFail, mcPanic})
	mcFaultGen   = rapid.SampledFrom([]string{"", "", "", "", "claim", "begin", "complete", "complete", "release", "fail"})
	mcWhenGen    = rapid.SampledFrom([]string{"before", "after"})
)

func (m *mcModel) drawFault(t *rapid.T, gen *rapid.Generator[string]) (method, when string) {
	method = gen.Draw(t, "fault")
	if method != "" {
		when = mcWhenGen.Draw(t, "when")
	}
	return method, when
}

func (m *mcModel) drawKey(t *rapid.T) (user, key string) {
	return rapid.SampledFrom(mcUsers).Draw(t, "user"), rapid.SampledFrom(mcKeys).Draw(t, "key")
}

func (m *mcModel) drawUsed(t *rapid.T) (user, key string, variant int) {
	if len(m.used) == 0 {
		t.Skip("no key used yet")
	}
	ks := make([][2]string, 0, len(m.used))
	for k := range m.used {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, func(a, b [2]string) int { return strings.Compare(a[0]+"/"+a[1], b[0]+"/"+b[1]) })
	k := rapid.SampledFrom(ks).Draw(t, "used")
	return k[0], k[1], m.used[k]
}

func (m *mcModel) markUsed(user, key string, v int) {
	if m.used == nil {
		m.used = map[[2]string]int{}
	}
	m.used[[2]string{user, key}] = v
}

// mcVariantGen mostly draws the first body, so that a key is often sent
// again with the same one (takeovers, replays, 409) rather than refused.
var mcVariantGen = rapid.SampledFrom([]int{0, 0, 0, 1})

func (m *mcModel) request(t *rapid.T) {
	user, key := m.drawKey(t)
	v := mcVariantGen.Draw(t, "variant")
	m.sequential(t, "request", user, key, v, mcBodies[v])
}

func (m *mcModel) retrySame(t *rapid.T) {
	user, key, v := m.drawUsed(t)
	body := mcBodies[v]
	if v == 0 && rapid.Bool().Draw(t, "respell") {
		body = mcBodyAlt0
	}
	m.sequential(t, "retry_same", user, key, v, body)
}

func (m *mcModel) retryOther(t *rapid.T) {
	user, key, v := m.drawUsed(t)
	m.sequential(t, "retry_other", user, key, 1-v, mcBodies[1-v])
}

func (m *mcModel) sequential(t *rapid.T, what, user, key string, v int, body string) {
	o := mcOutcomeGen.Draw(t, "outcome")
	method, when := m.drawFault(t, mcFaultGen)
	m.doSequential(t, what, user, key, v, body, o, method, when)
}

// doSequential sends one request with outcome o, the fault method/when
// armed, and checks its answer.
func (m *mcModel) doSequential(t *rapid.T, what, user, key string, v int, body string, o mcOutcome, method, when string) {
	m.begin(t, "%s %s/%s variant %d outcome %v fault %s/%s", what, user, key, v, o, method, when)
	pre := m.get(t, user, key)
	cls := m.classify(pre, v)
	suspect := m.suspect()
	plan := m.e.newPlan(o, mcNoHold)
	m.e.faults.arm(method, when)
	res := m.e.send(user, key, body, plan)
	fired := m.e.faults.disarm()
	m.markUsed(user, key, v)
	m.e.fx.count("class:"+cls.String(), 1)
	execs := m.execs(t)
	cat, op := m.explain(t, user, key, v, plan, res, fired, execs)
	t.Logf("  %v -> %d (%s) fired %v", cls, res.Code, cat, fired)
	m.expectOne(t, cls, pre, plan, cat, op, fired, suspect)
}

// expectOne checks the answer of one request (category cat, replayed
// operation op) against the class of the key's state before it.
func (m *mcModel) expectOne(t *rapid.T, cls mcClass, pre *idemdriver.Record, plan *mcPlan, cat, op string, fired []string, suspect bool) {
	if suspect && cat == "409" && cls != mcMismatch {
		if cls != mcInFlight {
			m.e.fx.count("redis:stale-409-accepted", 1)
		}
		return // a lease lock whose removal a Redis error lost
	}
	switch cls {
	case mcReplay:
		if cat != "replay" || op != mcOpOf(pre) {
			t.Fatalf("completed key with the same body: got %s (op %.12s), want a replay of op %.12s", cat, op, mcOpOf(pre))
		}
	case mcMismatch:
		if cat != "422" {
			t.Fatalf("key bound to the other body: got %s, want 422", cat)
		}
	case mcInFlight:
		if cat != "409" {
			t.Fatalf("key with a live lease: got %s, want 409", cat)
		}
	default:
		ran, _, _, final := plan.snapshot()
		if !ran {
			t.Fatalf("%v: the key was not claimed (answer %s)", cls, cat)
		}
		m.checkLease(t, cls, pre, plan)
		if want := mcWant(plan, final, fired); !slices.Contains(want, cat) {
			t.Fatalf("%v with outcome %v: got %s, want one of %v", cls, final, cat, want)
		}
	}
}

// mcWant lists the answers a handler run with outcome o may give to the
// request of plan p.
func mcWant(p *mcPlan, o mcOutcome, fired []string) []string {
	switch o {
	case mcRefuse:
		return []string{"400"}
	case mcFail, mcPanic:
		return []string{"500"}
	}
	if mcFiredOn(p, "complete", fired) {
		return []string{"503"}
	}
	return []string{"fresh"}
}

// checkLease checks that a claim kept or began the right operation.
func (m *mcModel) checkLease(t *rapid.T, cls mcClass, pre *idemdriver.Record, plan *mcPlan) {
	_, l, _, _ := plan.snapshot()
	switch cls {
	case mcClaimNew:
		if !l.CreatedAt.Equal(m.e.clock.Now()) || l.Attempt != 1 {
			t.Fatalf("new operation: lease created %v attempt %d, want %v attempt 1", l.CreatedAt, l.Attempt, m.e.clock.Now())
		}
	case mcClaimTakeover:
		m.e.fx.count("takeover", 1)
		if !l.CreatedAt.Equal(pre.CreatedAt) || l.Attempt != pre.Attempts+1 {
			t.Fatalf("takeover: lease created %v attempt %d, want the operation's %v attempt %d", l.CreatedAt, l.Attempt, pre.CreatedAt, pre.Attempts+1)
		}
	}
}

func (m *mcModel) classify(pre *idemdriver.Record, v int) mcClass {
	switch {
	case pre == nil:
		return mcClaimNew
	case pre.Fingerprint != m.e.fp[v]:
		return mcMismatch
	case pre.Response != nil:
		return mcReplay
	case m.e.clock.Now().Before(pre.LeaseUntil):
		return mcInFlight
	}
	return mcClaimTakeover
}

// explain sorts an answer into a category and checks what it says of
// itself: a replay equals its committed execution; a fresh 201 is this
// request's own committed execution; 400, 500 and 503 are this request's
// handler's outcome.
func (m *mcModel) explain(t *rapid.T, user, key string, v int, plan *mcPlan, res *httptest.ResponseRecorder, fired []string, execs []mcExec) (cat, op string) {
	defer func() { m.e.fx.count("answer:"+cat, 1) }()
	h := res.Header()
	if got := h.Get("Idempotency-Key"); got != key {
		t.Fatalf("answer %d echoes Idempotency-Key %q, want %q", res.Code, got, key)
	}
	body := res.Body.String()
	ran, _, attempt, final := plan.snapshot()
	if h.Get("Idempotent-Replayed") == "true" {
		var b struct{ Op string }
		if err := json.Unmarshal([]byte(body), &b); err != nil || b.Op == "" {
			t.Fatalf("replay %d with a body that is no execution's: %q", res.Code, body)
		}
		x, ok := mcFindExec(execs, func(x mcExec) bool { return x.Op == b.Op })
		if !ok {
			t.Fatalf("replay of op %.12s, which has no committed execution: %q", b.Op, body)
		}
		if res.Code != x.Status || body != x.Body || h.Get("Content-Type") != x.CType || h.Get("Location") != x.Location {
			t.Fatalf("replay %d %q (Content-Type %q, Location %q) differs from the first answer %d %q (%q, %q)",
				res.Code, body, h.Get("Content-Type"), h.Get("Location"), x.Status, x.Body, x.CType, x.Location)
		}
		if h.Get("Set-Cookie") != "" || h.Get("X-Mc-Attempt") != "" {
			t.Fatalf("replay carries headers that are never stored: %v", h)
		}
		if x.User != user || x.Key != key || x.Variant != v {
			t.Fatalf("replay for %s/%s variant %d is the answer of %s/%s variant %d", user, key, v, x.User, x.Key, x.Variant)
		}
		return "replay", b.Op
	}
	switch res.Code {
	case http.StatusCreated:
		if !ran || final != mcOK {
			t.Fatalf("fresh 201 from a request whose handler did not succeed (ran %v, outcome %v): %q", ran, final, body)
		}
		x, ok := mcFindExec(execs, func(x mcExec) bool { return x.Attempt == attempt })
		if !ok {
			t.Fatalf("fresh 201 of attempt %s whose execution did not commit: %q", attempt, body)
		}
		if body != x.Body || h.Get("Location") != x.Location {
			t.Fatalf("fresh 201 %q differs from its execution %q", body, x.Body)
		}
		return "fresh", ""
	case http.StatusConflict, http.StatusUnprocessableEntity:
		if ct := h.Get("Content-Type"); ct != "application/problem+json" {
			t.Fatalf("%d answered as %q, want application/problem+json", res.Code, ct)
		}
		if res.Code == http.StatusConflict && h.Get("Retry-After") == "" {
			t.Fatalf("409 without Retry-After")
		}
		return strconv.Itoa(res.Code), ""
	case http.StatusBadRequest:
		if !ran || final != mcRefuse || body != mcRefusedMsg {
			t.Fatalf("400 not from this request's refusal (ran %v, outcome %v): %q", ran, final, body)
		}
		return "400", ""
	case http.StatusInternalServerError:
		if !ran || (final != mcFail && final != mcPanic) {
			t.Fatalf("500 not from this request's failure (ran %v, outcome %v): %q", ran, final, body)
		}
		return "500", ""
	case http.StatusServiceUnavailable:
		if !ran || final != mcOK || !mcFiredOn(plan, "complete", fired) {
			t.Fatalf("503 without an injected fault (ran %v, outcome %v, fired %v): %q", ran, final, fired, body)
		}
		return "503", ""
	}
	t.Fatalf("unexpected answer %d %q", res.Code, body)
	return "", ""
}

// mcFiredOn reports whether a fault on method fired for p's request.
func mcFiredOn(p *mcPlan, method string, fired []string) bool {
	return slices.ContainsFunc(fired, func(f string) bool {
		return strings.HasPrefix(f, method+"/") && strings.HasSuffix(f, "@"+p.id)
	})
}

func mcFindExec(execs []mcExec, f func(mcExec) bool) (mcExec, bool) {
	i := slices.IndexFunc(execs, f)
	if i < 0 {
		return mcExec{}, false
	}
	return execs[i], true
}

func (m *mcModel) concurrent(t *rapid.T) {
	user, key := m.drawKey(t)
	v := mcVariantGen.Draw(t, "variant")
	n := rapid.IntRange(2, 4).Draw(t, "n")
	vs := make([]int, n)
	outs := make([]mcOutcome, n)
	mixed := rapid.IntRange(0, 4).Draw(t, "mixed") == 0 // one request with the other body
	for i := range outs {
		vs[i] = v
		if mixed && i == n-1 {
			vs[i] = 1 - v
		}
		outs[i] = mcOutcomeGen.Draw(t, "outcome")
	}
	withCompleter := rapid.IntRange(0, 3).Draw(t, "completer") == 0
	co := mcOK
	if withCompleter {
		co = mcOutcomeGen.Draw(t, "completer outcome")
	}
	method, when := m.drawFault(t, mcFaultGen)
	m.doConcurrent(t, user, key, vs, outs, withCompleter, co, method, when)
}

// doConcurrent sends len(outs) requests with the same key at once,
// request i with body vs[i] and outcome outs[i], with a completer scan
// (its re-drives with outcome co) racing them if withCompleter, and
// checks their answers.
func (m *mcModel) doConcurrent(t *rapid.T, user, key string, vs []int, outs []mcOutcome, withCompleter bool, co mcOutcome, method, when string) {
	n := len(outs)
	plans := make([]*mcPlan, n)
	for i := range plans {
		plans[i] = m.e.newPlan(outs[i], mcNoHold)
	}
	mixed := slices.ContainsFunc(vs, func(v int) bool { return v != vs[0] })
	m.begin(t, "concurrent %s/%s variants %v outcomes %v completer %v (%v) fault %s/%s", user, key, vs, outs, withCompleter, co, method, when)
	pre := m.get(t, user, key)
	suspect := m.suspect()
	m.e.plansMu.Lock()
	m.e.completerPlan = co
	m.e.plansMu.Unlock()
	m.e.faults.arm(method, when)
	res := make([]*httptest.ResponseRecorder, n)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	for i := range plans {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-gate
			res[i] = m.e.send(user, key, mcBodies[vs[i]], plans[i])
		}()
	}
	var cst idem.CompleterStats
	var cerr error
	if withCompleter {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-gate
			cst, cerr = m.e.comp.RunOnce(context.Background())
		}()
	}
	close(gate)
	m.wait(t, &wg)
	fired := m.e.faults.disarm()
	for _, v := range vs {
		m.markUsed(user, key, v)
	}
	execs := m.execs(t)
	if cerr != nil && !slices.ContainsFunc(fired, func(f string) bool { return strings.HasPrefix(f, "abandoned/") }) {
		t.Fatalf("completer: %v", cerr)
	}
	var cats []string
	fresh, claimed, claimable := 0, 0, 0
	for i, p := range plans {
		cls := m.classify(pre, vs[i])
		m.e.fx.count("class:"+cls.String(), 1)
		cat, op := m.explain(t, user, key, vs[i], p, res[i], fired, execs)
		cats = append(cats, cat)
		ran, l, _, final := p.snapshot()
		switch cls {
		case mcClaimNew, mcClaimTakeover:
			claimable++
			if ran {
				claimed++
				// The first claim begins or takes over the operation;
				// later ones (after a 5xx, a panic or a refusal) take
				// it over again, or begin it again at the same time.
				want, first := m.e.clock.Now(), 1
				if cls == mcClaimTakeover {
					want, first = pre.CreatedAt, pre.Attempts+1
				}
				if !l.CreatedAt.Equal(want) || l.Attempt < first {
					t.Fatalf("goroutine %d: lease created %v attempt %d, want the operation's %v and attempt >= %d", i, l.CreatedAt, l.Attempt, want, first)
				}
				if want := mcWant(p, final, fired); !slices.Contains(want, cat) {
					t.Fatalf("goroutine %d ran with outcome %v: got %s, want one of %v", i, final, cat, want)
				}
			} else if cat != "409" && cat != "replay" && (cat != "422" || !mixed) {
				t.Fatalf("goroutine %d did not run: got %s, want 409, a replay or (bodies mixed) 422", i, cat)
			}
			if cat == "replay" {
				if x, _ := mcFindExec(execs, func(x mcExec) bool { return x.Op == op }); x.User != user || x.Key != key {
					t.Fatalf("replay of another key's operation")
				}
				if cls == mcClaimTakeover && op != mcOpOf(pre) {
					t.Fatalf("replay of op %.12s, not of the operation taken over", op)
				}
			}
			if cat == "fresh" {
				fresh++
			}
		default:
			m.expectOne(t, cls, pre, p, cat, op, fired, suspect)
		}
	}
	t.Logf("  %v -> %v; completer %+v; fired %v", m.classify(pre, vs[0]), cats, cst, fired)
	if fresh > 1 {
		t.Fatalf("%d fresh 201 answers for one key in one step", fresh)
	}
	if claimable > 0 && claimed == 0 && !suspect && !withCompleter {
		t.Fatalf("none of %d concurrent requests claimed a claimable key: %v", n, cats)
	}
}

// wait waits for wg, bounded so that a deadlock fails instead of hanging.
func (m *mcModel) wait(t *rapid.T, wg *sync.WaitGroup) {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(mcWait):
		t.Fatalf("requests still running after %v", mcWait)
	}
}

func (m *mcModel) hold(t *rapid.T) {
	user, key := m.drawKey(t)
	v := mcVariantGen.Draw(t, "variant")
	where := rapid.SampledFrom([]mcHold{mcHoldBeforeCharge, mcHoldAfterCharge}).Draw(t, "where")
	m.doHold(t, user, key, v, where)
}

// doHold sends a request whose handler blocks at where, and waits until
// it blocks or answers.
func (m *mcModel) doHold(t *rapid.T, user, key string, v int, where mcHold) {
	m.begin(t, "hold %s/%s variant %d (hold %d)", user, key, v, where)
	pre := m.get(t, user, key)
	cls := m.classify(pre, v)
	suspect := m.suspect()
	plan := m.e.newPlan(mcOK, where)
	h := &mcHeld{user: user, key: key, variant: v, plan: plan, done: make(chan *httptest.ResponseRecorder, 1)}
	go func() { h.done <- m.e.send(user, key, mcBodies[v], plan) }()
	m.markUsed(user, key, v)
	select {
	case <-plan.reached:
		if cls != mcClaimNew && cls != mcClaimTakeover {
			t.Fatalf("%v: a held request ran its handler", cls)
		}
		m.checkLease(t, cls, pre, plan)
		m.held = append(m.held, h)
		t.Logf("  %v -> held (owner %.8s)", cls, plan.lease.Owner)
	case res := <-h.done:
		cat, op := m.explain(t, user, key, v, plan, res, nil, m.execs(t))
		t.Logf("  %v -> %d (%s)", cls, res.Code, cat)
		if cls == mcClaimNew || cls == mcClaimTakeover {
			if !(suspect && cat == "409") {
				t.Fatalf("%v: the held request did not run (answer %s)", cls, cat)
			}
			return
		}
		m.expectOne(t, cls, pre, plan, cat, op, nil, suspect)
	case <-time.After(mcWait):
		t.Fatalf("held request neither ran nor answered after %v", mcWait)
	}
}

func (m *mcModel) release(t *rapid.T) {
	if len(m.held) == 0 {
		t.Skip("nothing held")
	}
	i := rapid.IntRange(0, len(m.held)-1).Draw(t, "held")
	h := m.held[i]
	outs := []mcOutcome{mcOK, mcOK, mcFail, mcPanic}
	if h.plan.hold == mcHoldBeforeCharge {
		outs = append(outs, mcRefuse)
	}
	o := rapid.SampledFrom(outs).Draw(t, "outcome")
	method, when := m.drawFault(t, mcFaultGen)
	m.begin(t, "release held %s/%s (owner %.8s) outcome %v fault %s/%s", h.user, h.key, h.plan.lease.Owner, o, method, when)
	m.releaseHeld(t, i, o, method, when)
}

func (m *mcModel) releaseHeld(t *rapid.T, i int, o mcOutcome, method, when string) {
	h := m.held[i]
	m.held = slices.Delete(m.held, i, i+1)
	pre := m.get(t, h.user, h.key)
	_, l, attempt, _ := h.plan.snapshot()
	own := pre != nil && pre.Response == nil && pre.Owner == l.Owner
	m.e.faults.arm(method, when)
	h.plan.release <- o
	var res *httptest.ResponseRecorder
	select {
	case res = <-h.done:
	case <-time.After(mcWait):
		t.Fatalf("released request did not answer after %v", mcWait)
	}
	fired := m.e.faults.disarm()
	execs := m.execs(t)
	cat, _ := m.explain(t, h.user, h.key, h.variant, h.plan, res, fired, execs)
	t.Logf("  own %v -> %d (%s) fired %v", own, res.Code, cat, fired)
	m.e.fx.count(fmt.Sprintf("release:own=%v:%s", own, cat), 1)
	want := mcWant(h.plan, o, fired)
	if !own {
		if o == mcOK {
			want = []string{"409"} // fenced
			if mcFiredOn(h.plan, "complete", fired) {
				want = []string{"503"} // the fence was never reached, or its answer lost
			}
		}
		if _, ok := mcFindExec(execs, func(x mcExec) bool { return x.Attempt == attempt }); ok {
			t.Fatalf("a taken-over attempt committed its execution")
		}
	}
	if !slices.Contains(want, cat) {
		t.Fatalf("released held request (own %v, outcome %v): got %s, want one of %v", own, o, cat, want)
	}
}

func (m *mcModel) advance(t *rapid.T) {
	d := rapid.SampledFrom([]time.Duration{time.Second, 5 * time.Second, 29 * time.Second, mcLease + time.Second,
		mcLease + mcMaxBackoff + time.Second, mcTTL + time.Second}).Draw(t, "d")
	m.doAdvance(t, d)
}

func (m *mcModel) doAdvance(t *rapid.T, d time.Duration) {
	m.begin(t, "advance %v", d)
	m.e.clock.Advance(d)
}

func (m *mcModel) completer(t *rapid.T) {
	o := mcOutcomeGen.Draw(t, "outcome")
	method, when := m.drawFault(t, rapid.SampledFrom([]string{"", "", "", "abandoned", "claim", "begin", "complete", "fail"}))
	m.doCompleter(t, o, method, when)
}

// doCompleter runs the completer once, its re-drives with outcome o.
func (m *mcModel) doCompleter(t *rapid.T, o mcOutcome, method, when string) {
	m.begin(t, "completer re-drives with outcome %v fault %s/%s", o, method, when)
	before := len(m.execs(t))
	m.e.plansMu.Lock()
	m.e.completerPlan = o
	m.e.plansMu.Unlock()
	m.e.faults.arm(method, when)
	st, err := m.e.comp.RunOnce(context.Background())
	fired := m.e.faults.disarm()
	after := len(m.execs(t))
	t.Logf("  %+v err %v fired %v; %d new executions", st, err, fired, after-before)
	m.e.fx.count("completer:completed", st.Completed)
	m.e.fx.count("completer:failed", st.Failed)
	if err != nil && len(fired) == 0 {
		t.Fatalf("completer: %v", err)
	}
	if len(fired) == 0 && st.Completed != after-before {
		t.Fatalf("completer reports %d completed, %d executions committed", st.Completed, after-before)
	}
}

// drain runs the completer, with re-drives that succeed and no faults,
// until nothing is abandoned; then every payment must have its order.
func (m *mcModel) drain(t *rapid.T) {
	ctx := context.Background()
	m.e.faults.disarm()
	m.e.plansMu.Lock()
	m.e.completerPlan = mcOK
	m.e.plansMu.Unlock()
	m.e.clock.Advance(mcLease + mcMaxBackoff + time.Second)
	var left []idemdriver.Record
	for round := 0; round < 8; round++ {
		st, err := m.e.comp.RunOnce(ctx)
		if err != nil {
			t.Fatalf("drain: completer: %v", err)
		}
		left, err = m.e.rawSw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 1000})
		if err != nil {
			t.Fatalf("drain: Abandoned: %v", err)
		}
		t.Logf("  round %d: %+v; %d left", round, st, len(left))
		m.e.fx.count("drain:completed", st.Completed)
		if len(left) == 0 {
			break
		}
		m.e.clock.Advance(mcMaxBackoff + time.Second)
	}
	if len(left) > 0 {
		t.Fatalf("drain: %d keys still abandoned after the completer ran", len(left))
	}
	execs := m.execs(t)
	for k, c := range m.e.charges() {
		if _, ok := mcFindExec(execs, func(x mcExec) bool { return x.Op == k }); !ok {
			t.Fatalf("drain: payment %s of %s/%s (op %.12s) has no committed execution after the completer ran", c.ID, c.User, c.IKey, k)
		}
	}
}

func (m *mcModel) gc(t *rapid.T) {
	method, when := m.drawFault(t, rapid.SampledFrom([]string{"", "", "deleteExpired"}))
	m.begin(t, "gc fault %s/%s", method, when)
	m.e.faults.arm(method, when)
	n, err := m.e.store.DeleteExpired(context.Background(), 100)
	fired := m.e.faults.disarm()
	t.Logf("  deleted %d err %v", n, err)
	if err != nil && len(fired) == 0 {
		t.Fatalf("DeleteExpired: %v", err)
	}
}

func (m *mcModel) redisFlush(t *rapid.T) {
	m.begin(t, "redis flushed (our prefix)")
	if err := m.e.fx.flush(context.Background(), m.e.prefix); err != nil {
		t.Fatalf("flushing Redis: %v", err)
	}
}

func (m *mcModel) redisDownStep(t *rapid.T) {
	if m.redisDown {
		t.Skip("Redis already down")
	}
	m.begin(t, "redis down")
	m.e.fx.proxy.Stop()
	m.e.fx.count("redis:down", 1)
	m.redisDown = true
	m.redisTrouble = time.Now()
}

func (m *mcModel) redisUpStep(t *rapid.T) {
	if !m.redisDown {
		t.Skip("Redis is up")
	}
	m.begin(t, "redis up")
	m.redisUp(t)
}

func (m *mcModel) redisUp(t *rapid.T) {
	if err := m.e.fx.proxy.Start(); err != nil {
		t.Fatalf("restarting the Redis proxy: %v", err)
	}
	m.redisDown = false
	m.redisTrouble = time.Now()
}

// suspect reports whether Redis may hold a lease lock whose removal was
// lost (an outage or an error within LockTTL and a margin): such a lock
// answers 409 until it runs out.
func (m *mcModel) suspect() bool {
	return m.e.rf != nil && time.Since(m.redisTrouble) < mcLockTTL+500*time.Millisecond
}

func (m *mcModel) get(t *rapid.T, user, key string) *idemdriver.Record {
	rec, err := m.e.get(context.Background(), user, key)
	if err != nil {
		t.Fatalf("Get(%s/%s): %v", user, key, err)
	}
	return rec
}

func (m *mcModel) execs(t *rapid.T) []mcExec {
	x, err := m.e.execs(context.Background())
	if err != nil {
		t.Fatalf("reading executions: %v", err)
	}
	return x
}

// check is the invariant run after every step.
func (m *mcModel) check(t *rapid.T) {
	if m.e.rf != nil {
		if n := m.e.rf.Metrics().RedisErrors.Load(); n != m.redisErrors {
			m.redisErrors, m.redisTrouble = n, time.Now()
		}
	}
	if a := m.e.takeAnomalies(); len(a) > 0 {
		t.Fatalf("anomalies: %v", a)
	}
	execs := m.execs(t)
	charges := m.e.charges()
	byOp := map[string]mcExec{}
	for _, x := range execs {
		if prev, dup := byOp[x.Op]; dup {
			t.Fatalf("two committed executions of one operation %s/%s (op %.12s): attempts %s and %s", x.User, x.Key, x.Op, prev.Attempt, x.Attempt)
		}
		byOp[x.Op] = x
		c, ok := charges[x.Op]
		if !ok || c.User != x.User || c.IKey != x.Key || c.Amount != mcAmounts[x.Variant] {
			t.Fatalf("execution %s of %s/%s without its charge (%+v)", x.Attempt, x.User, x.Key, c)
		}
	}
	pendingOps := map[string]bool{}
	for _, u := range mcUsers {
		for _, k := range mcKeys {
			rec := m.get(t, u, k)
			if rec == nil {
				continue
			}
			op := mcOpOf(rec)
			x, done := byOp[op]
			if rec.Response == nil {
				if done {
					t.Fatalf("%s/%s: execution %s committed, but the record holds no answer", u, k, x.Attempt)
				}
				pendingOps[op] = true
				continue
			}
			if !done {
				t.Fatalf("%s/%s: the record holds an answer (%d) without a committed execution", u, k, rec.Response.Status)
			}
			r := rec.Response
			if r.Status != x.Status || string(r.Body) != x.Body || r.Header.Get("Content-Type") != x.CType ||
				r.Header.Get("Location") != x.Location || r.Header.Get("Set-Cookie") != "" || r.Header.Get("X-Mc-Attempt") != "" {
				t.Fatalf("%s/%s: the stored answer %d %q %v is not its execution's %d %q", u, k, r.Status, r.Body, r.Header, x.Status, x.Body)
			}
			if rec.Fingerprint != m.e.fp[x.Variant] {
				t.Fatalf("%s/%s: completed under another body's fingerprint", u, k)
			}
		}
	}
	for k, c := range charges {
		if _, ok := byOp[k]; !ok && !pendingOps[k] {
			t.Fatalf("payment %s of %s/%s (op %.12s) has neither its execution nor a record left to finish it", c.ID, c.User, c.IKey, k)
		}
	}
}

// finish releases what is held, brings Redis back, and drains.
func (m *mcModel) finish(t *rapid.T) {
	m.begin(t, "finish: release %d held, drain", len(m.held))
	for len(m.held) > 0 {
		m.releaseHeld(t, 0, mcOK, "", "")
		m.check(t)
	}
	if m.redisDown {
		m.redisUp(t)
	}
	m.drain(t)
	m.check(t)
}

// teardown lets held handlers end (after a failure) and closes the store.
func (m *mcModel) teardown() {
	for _, h := range m.held {
		select {
		case h.plan.release <- mcFail:
		default:
		}
		select {
		case <-h.done:
		case <-time.After(mcWait):
		}
	}
	m.held = nil
	if m.redisDown {
		_ = m.e.fx.proxy.Start() // teardown, best effort
	}
	m.e.close()
}
