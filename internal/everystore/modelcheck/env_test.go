package modelcheck

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/redisfront"
	"github.com/idem-go/idem/sqlitestore"
	"github.com/idem-go/idem/storetest"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"
	"pgregory.net/rapid"
)

// mcKind names a store under test.
type mcKind int

const (
	mcMem mcKind = iota
	mcSQLite
	mcPG
	mcRedis // redisfront in front of pgstore
)

func (k mcKind) String() string {
	return [...]string{"memstore", "sqlitestore", "pgstore", "redisfront+pgstore"}[k]
}

// The protocol's times in the model, on the fake clock.
const (
	mcLease      = 30 * time.Second
	mcTTL        = 10 * time.Minute
	mcBackoff    = time.Second
	mcMaxBackoff = 4 * time.Second
	mcLockTTL    = 250 * time.Millisecond // redisfront's lease locks, real time
	mcWait       = 60 * time.Second       // liveness bound on one request (real time)
)

var mcDiscard = slog.New(slog.NewTextHandler(io.Discard, nil))

// The two request bodies (variants) a key can be used with, and a second
// spelling of variant 0 with the same meaning (same fingerprint).
var (
	mcBodies     = [2]string{`{"amount":100,"currency":"EUR"}`, `{"amount":250,"currency":"EUR"}`}
	mcBodyAlt0   = `{ "currency": "EUR", "amount": 100 }`
	mcAmounts    = [2]int{100, 250}
	mcUsers      = []string{"alice", "bob"}
	mcKeys       = []string{"k0", "k1", "k2"}
	mcPath       = "/v1/orders"
	mcRefusedMsg = `{"mc":"refused"}`
	mcFailedMsg  = `{"mc":"failed"}`
)

// mcRedisURL is the tests' Redis: TEST_REDIS_URL, or under CI=true the
// machine's; elsewhere the test is skipped.
func mcRedisURL(t testing.TB) string {
	t.Helper()
	if u := os.Getenv("TEST_REDIS_URL"); u != "" {
		return u
	}
	if os.Getenv("CI") == "true" {
		return "redis://127.0.0.1:6379"
	}
	t.Skip("modelcheck: Redis model skipped: set TEST_REDIS_URL (e.g. redis://127.0.0.1:6379) or CI=true")
	return ""
}

// mcFixture is what one store's test shares between its checks: a
// directory, a PostgreSQL schema and pool, Redis clients and the proxy.
// Each check (one rapid test case) gets a fresh store on top of it.
type mcFixture struct {
	kind   mcKind
	dir    string
	pool   *pgxpool.Pool
	direct *redis.Client // straight to Redis: flushing our prefix
	rdb    *redis.Client // through the proxy: what redisfront uses
	proxy  *toxiproxy.Proxy
	base   string // Redis key prefix of this test
	n      atomic.Int64

	statsMu sync.Mutex
	stats   map[string]int // what the checks saw, for the test's log
}

func (fx *mcFixture) count(what string, n int) {
	fx.statsMu.Lock()
	defer fx.statsMu.Unlock()
	if fx.stats == nil {
		fx.stats = map[string]int{}
	}
	fx.stats[what] += n
}

func (fx *mcFixture) summary() string {
	fx.statsMu.Lock()
	defer fx.statsMu.Unlock()
	names := make([]string, 0, len(fx.stats))
	for k := range fx.stats {
		names = append(names, k)
	}
	sort.Strings(names)
	var b strings.Builder
	for _, k := range names {
		fmt.Fprintf(&b, " %s=%d", k, fx.stats[k])
	}
	return b.String()
}

func mcNewFixture(t *testing.T, kind mcKind) *mcFixture {
	fx := &mcFixture{kind: kind, dir: t.TempDir()}
	ctx := context.Background()
	if kind == mcPG || kind == mcRedis {
		fx.pool = pgtest.Pool(t, pgtest.MaxConns(10))
		if err := pgstore.Migrate(ctx, fx.pool); err != nil {
			t.Fatalf("pgstore.Migrate: %v", err)
		}
		if _, err := fx.pool.Exec(ctx, mcExecDDL); err != nil {
			t.Fatalf("creating mc_exec: %v", err)
		}
	}
	if kind == mcRedis {
		u := mcRedisURL(t)
		opt, err := redis.ParseURL(u)
		if err != nil {
			t.Fatalf("TEST_REDIS_URL %q: %v", u, err)
		}
		fx.direct = redis.NewClient(opt)
		t.Cleanup(func() { fx.direct.Close() })
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if err := fx.direct.Ping(pctx).Err(); err != nil {
			t.Fatalf("Redis at %s does not answer: %v", u, err)
		}
		srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
		fx.proxy = toxiproxy.NewProxy(srv, "mc-redis", "127.0.0.1:0", opt.Addr)
		if err := fx.proxy.Start(); err != nil {
			t.Fatalf("starting the Redis proxy: %v", err)
		}
		t.Cleanup(fx.proxy.Stop)
		popt := *opt
		popt.Addr = fx.proxy.Listen
		popt.ContextTimeoutEnabled = true
		popt.DialTimeout = 200 * time.Millisecond
		popt.DialerRetries = 1 // an outage is answered at once, not after 5 dials
		popt.MaxRetries = -1
		fx.rdb = redis.NewClient(&popt)
		t.Cleanup(func() { fx.rdb.Close() })
		fx.base = fmt.Sprintf("mc:modelcheck:%s:", idemdriver.NewOwner()[:12])
		t.Cleanup(func() {
			if err := fx.flush(context.Background(), fx.base); err != nil {
				t.Errorf("removing the run's Redis keys: %v", err)
			}
		})
	}
	return fx
}

// flush deletes the Redis keys under prefix, and only those.
func (fx *mcFixture) flush(ctx context.Context, prefix string) error {
	iter := fx.direct.Scan(ctx, 0, prefix+"*", 500).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	if err := iter.Err(); err != nil {
		return err
	}
	for len(keys) > 0 {
		n := min(len(keys), 200)
		if err := fx.direct.Del(ctx, keys[:n]...).Err(); err != nil {
			return err
		}
		keys = keys[n:]
	}
	return nil
}

const mcExecDDL = `CREATE TABLE mc_exec (
	op TEXT NOT NULL, attempt TEXT NOT NULL, usr TEXT NOT NULL, ikey TEXT NOT NULL,
	variant INTEGER NOT NULL, status INTEGER NOT NULL, body TEXT NOT NULL,
	ctype TEXT NOT NULL, location TEXT NOT NULL)`

// mcExec is one committed execution row: the handler's write, made in
// the request's transaction, with the answer it gave.
type mcExec struct {
	Op, Attempt, User, Key string
	Variant, Status        int
	Body, CType, Location  string
}

// mcOutcome is what the handler does with an attempt.
type mcOutcome int

const (
	mcOK     mcOutcome = iota // charge, write the execution, 201
	mcRefuse                  // 400 before anything (no charge)
	mcFail                    // charge, then 500
	mcPanic                   // charge, then panic
)

func (o mcOutcome) String() string { return [...]string{"2xx", "4xx", "5xx", "panic"}[o] }

// mcHold says where a held handler blocks.
type mcHold int

const (
	mcNoHold mcHold = iota
	mcHoldBeforeCharge
	mcHoldAfterCharge
)

// mcPlan is the script of one request's handler run, and what the run
// recorded.
type mcPlan struct {
	id      string
	outcome mcOutcome
	hold    mcHold
	reached chan struct{}  // closed when a held handler blocks
	release chan mcOutcome // the held handler's final outcome

	mu      sync.Mutex
	ran     bool
	lease   idemdriver.Lease
	attempt string
	final   mcOutcome
}

func (p *mcPlan) snapshot() (ran bool, lease idemdriver.Lease, attempt string, final mcOutcome) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ran, p.lease, p.attempt, p.final
}

// mcCharge is a payment at the fake gateway, keyed by the derived key.
type mcCharge struct {
	ID, Key, User, IKey string
	CreatedAt           time.Time
	Amount, Calls       int
}

// mcGateway charges once per derived key, as Stripe does per
// Idempotency-Key.
type mcGateway struct {
	mu      sync.Mutex
	charges map[string]*mcCharge
}

// mcFaults holds the injected store errors armed for the current step:
// one per method name, each firing once.
type mcFaults struct {
	mu     sync.Mutex
	armed  map[string]string // method -> "before" | "after"
	fired  []string
	onFire func(method, when string)
}

var errMcInjected = errors.New("modelcheck: injected store error")

func (f *mcFaults) arm(method, when string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.armed = map[string]string{}
	f.fired = nil
	if method != "" {
		f.armed[method] = when
	}
}

// disarm clears what is armed and returns what fired since arm.
func (f *mcFaults) disarm() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	fired := f.fired
	f.armed, f.fired = map[string]string{}, nil
	return fired
}

// mcPlanKey is the context key of a request's plan id, so that a fault
// that fires is known by the request it hit.
type mcPlanKey struct{}

// take consumes the fault armed for method, if any, noting it as fired
// for the request of ctx ("method/when@plan").
func (f *mcFaults) take(ctx context.Context, method string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	w := f.armed[method]
	if w != "" {
		delete(f.armed, method)
		id, _ := ctx.Value(mcPlanKey{}).(string)
		f.fired = append(f.fired, method+"/"+w+"@"+id)
		if f.onFire != nil {
			f.onFire(method, w)
		}
	}
	return w
}

// mcFaultStore wraps a store: an armed "before" fault returns an error
// without calling the inner store, an "after" fault calls it and then
// returns an error (the answer lost on the way back). Begin and
// Tx.Complete end the inner transaction they leave behind, as a driver or
// store would.
type mcFaultStore struct {
	inner  idem.Store
	sw     idemdriver.Sweeper
	f      *mcFaults
	mutant string
}

func (s *mcFaultStore) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	w := s.f.take(ctx, "claim")
	if w == "before" {
		return idemdriver.Claim{}, errMcInjected
	}
	c, err := s.inner.Claim(ctx, p)
	if w == "after" {
		return idemdriver.Claim{}, errMcInjected
	}
	return c, err
}

func (s *mcFaultStore) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	w := s.f.take(ctx, "begin")
	if w == "before" {
		return nil, errMcInjected
	}
	tx, err := s.inner.Begin(ctx, l)
	if w == "after" {
		// The transaction was opened but its handle was lost: the driver
		// would end it with the connection.
		if err == nil {
			tx.Rollback(ctx)
		}
		return nil, errMcInjected
	}
	if err != nil {
		return nil, err
	}
	return &mcFaultTx{inner: tx, f: s.f, mutant: s.mutant}, nil
}

func (s *mcFaultStore) Release(ctx context.Context, l *idemdriver.Lease) error {
	return s.call(ctx, "release", func() error { return s.inner.Release(ctx, l) })
}

func (s *mcFaultStore) Fail(ctx context.Context, l *idemdriver.Lease) error {
	if s.mutant == mcMutantFailReleases {
		return s.call(ctx, "fail", func() error { return s.inner.Release(ctx, l) })
	}
	return s.call(ctx, "fail", func() error { return s.inner.Fail(ctx, l) })
}

func (s *mcFaultStore) Get(ctx context.Context, user, key string) (*idemdriver.Record, error) {
	return s.inner.Get(ctx, user, key)
}

func (s *mcFaultStore) Abandoned(ctx context.Context, p idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	var recs []idemdriver.Record
	err := s.call(ctx, "abandoned", func() error {
		var err error
		recs, err = s.sw.Abandoned(ctx, p)
		return err
	})
	return recs, err
}

func (s *mcFaultStore) DeleteExpired(ctx context.Context, limit int) (int, error) {
	var n int
	err := s.call(ctx, "deleteExpired", func() error {
		var err error
		n, err = s.sw.DeleteExpired(ctx, limit)
		return err
	})
	return n, err
}

func (s *mcFaultStore) call(ctx context.Context, method string, fn func() error) error {
	w := s.f.take(ctx, method)
	if w == "before" {
		return errMcInjected
	}
	err := fn()
	if w == "after" {
		return errMcInjected
	}
	return err
}

type mcFaultTx struct {
	inner  idem.Tx
	f      *mcFaults
	mutant string
}

func (tx *mcFaultTx) Unwrap() idem.Tx { return tx.inner }

func (tx *mcFaultTx) Complete(ctx context.Context, resp *idemdriver.Response) error {
	w := tx.f.take(ctx, "complete")
	if w == "before" {
		// Nothing reaches the store's commit; the transaction ends as a
		// store's failed Complete ends it (every store rolls back before
		// it returns an error), so that it does not hold SQLite's write
		// lock while the middleware fails the lease.
		tx.inner.Rollback(ctx)
		return errMcInjected
	}
	if tx.mutant == mcMutantCompleteLies {
		return tx.inner.Rollback(ctx)
	}
	err := tx.inner.Complete(ctx, resp)
	if w == "after" {
		return errMcInjected
	}
	return err
}

func (tx *mcFaultTx) Rollback(ctx context.Context) error { return tx.inner.Rollback(ctx) }

// mcEnv is one check's world: a fresh store on the fixture, its clock,
// the fault wrapper, the middleware and completer, the gateway, and the
// plans of the requests in flight.
type mcEnv struct {
	fx     *mcFixture
	clock  *storetest.Clock
	raw    idem.Store // the store itself (for redisfront: the redisfront Store)
	rawSw  idemdriver.Sweeper
	rf     *redisfront.Store
	faults *mcFaults
	store  *mcFaultStore
	mw     http.Handler
	comp   *idem.Completer
	gw     *mcGateway
	sqlite *sqlitestore.Store
	dbPath string
	prefix string

	plansMu       sync.Mutex
	plans         map[string]*mcPlan
	completerPlan mcOutcome
	planSeq       atomic.Int64
	attemptSeq    atomic.Int64

	memMu    sync.Mutex
	memExecs []mcExec

	anomMu    sync.Mutex
	anomalies []string

	fp [2]string // fingerprints of the variants

	mutant string // IDEM_MODELCHECK_MUTANT: a deliberate bug, to see the oracle catch it
}

// The mutants IDEM_MODELCHECK_MUTANT may name. Each breaks the system
// under test on purpose (in this package's wrapper or handler, never in
// the protocol's code), so that a run shows the oracle failing; the
// default run has none.
const (
	mcMutantExecOutsideTx = "exec-outside-tx" // the handler writes its execution outside the request's transaction
	mcMutantFailReleases  = "fail-releases"   // Store.Fail deletes the record instead of ending the lease
	mcMutantCompleteLies  = "complete-lies"   // Tx.Complete rolls back and reports success
)

func (fx *mcFixture) newEnv(t *rapid.T) *mcEnv {
	ctx := context.Background()
	e := &mcEnv{
		fx:     fx,
		clock:  storetest.NewClock(time.Date(2030, 1, 1, 12, 0, 0, 0, time.UTC)),
		faults: &mcFaults{armed: map[string]string{}},
		gw:     &mcGateway{charges: map[string]*mcCharge{}},
		plans:  map[string]*mcPlan{},
		mutant: os.Getenv("IDEM_MODELCHECK_MUTANT"),
	}
	e.faults.onFire = func(method, when string) { fx.count("fault:"+method+"/"+when, 1) }
	n := fx.n.Add(1)
	switch fx.kind {
	case mcMem:
		e.raw = memstore.New(memstore.Options{Now: e.clock.Now})
	case mcSQLite:
		e.dbPath = filepath.Join(fx.dir, fmt.Sprintf("check-%d.db", n))
		s, err := sqlitestore.Open(ctx, e.dbPath, sqlitestore.Options{Now: e.clock.Now})
		if err != nil {
			t.Fatalf("sqlitestore.Open: %v", err)
		}
		if _, err := s.DB().ExecContext(ctx, mcExecDDL); err != nil {
			t.Fatalf("creating mc_exec: %v", err)
		}
		e.sqlite, e.raw = s, s
	case mcPG, mcRedis:
		if _, err := fx.pool.Exec(ctx, `TRUNCATE idempotency_keys, mc_exec`); err != nil {
			t.Fatalf("truncating: %v", err)
		}
		var inner idem.Store = pgstore.New(fx.pool, pgstore.Options{Now: e.clock.Now})
		e.raw = inner
		if fx.kind == mcRedis {
			e.prefix = fmt.Sprintf("%s%d:", fx.base, n)
			e.rf = redisfront.New(fx.rdb, inner, redisfront.Options{
				KeyPrefix: e.prefix, Now: e.clock.Now, LockTTL: mcLockTTL, Logger: mcDiscard,
			})
			e.raw = e.rf
		}
	}
	e.rawSw = e.raw.(idemdriver.Sweeper)
	e.store = &mcFaultStore{inner: e.raw, sw: e.rawSw, f: e.faults, mutant: e.mutant}
	mo := idem.Options{
		TTL: mcTTL, Lease: mcLease, Logger: mcDiscard,
		User: func(r *http.Request) string { return r.Header.Get("X-Mc-User") },
	}
	h := http.HandlerFunc(e.handle)
	e.mw = idem.Middleware(e.store, mo)(h)
	comp := idem.NewCompleter(e.store, h, idem.CompleterOptions{
		MaxAttempts: 1000, Backoff: mcBackoff, MaxBackoff: mcMaxBackoff, Batch: 100, Middleware: mo, Logger: mcDiscard,
	})
	e.comp = comp
	for v, b := range mcBodies {
		req := httptest.NewRequest(http.MethodPost, mcPath, bytes.NewReader([]byte(b)))
		fp, err := idem.Fingerprint(req, []byte(b))
		if err != nil {
			t.Fatalf("Fingerprint: %v", err)
		}
		e.fp[v] = fp
	}
	return e
}

func (e *mcEnv) close() {
	if e.sqlite != nil {
		e.sqlite.Close()
		for _, suffix := range []string{"", "-wal", "-shm"} {
			os.Remove(e.dbPath + suffix) // a long run opens thousands
		}
	}
	if e.prefix != "" {
		_ = e.fx.flush(context.Background(), e.prefix) // best effort; the fixture's cleanup removes the rest
	}
}

func (e *mcEnv) anomaly(format string, args ...any) {
	e.anomMu.Lock()
	defer e.anomMu.Unlock()
	e.anomalies = append(e.anomalies, fmt.Sprintf(format, args...))
}

func (e *mcEnv) takeAnomalies() []string {
	e.anomMu.Lock()
	defer e.anomMu.Unlock()
	a := e.anomalies
	e.anomalies = nil
	return a
}

func (e *mcEnv) newPlan(o mcOutcome, hold mcHold) *mcPlan {
	p := &mcPlan{id: fmt.Sprint(e.planSeq.Add(1)), outcome: o, hold: hold}
	if hold != mcNoHold {
		p.reached = make(chan struct{})
		p.release = make(chan mcOutcome, 1)
	}
	e.plansMu.Lock()
	e.plans[p.id] = p
	e.plansMu.Unlock()
	return p
}

// planOf returns the request's plan; a completer's re-drive, which
// carries none, gets a plan from the completer's outcome.
func (e *mcEnv) planOf(r *http.Request) *mcPlan {
	e.plansMu.Lock()
	p := e.plans[r.Header.Get("X-Mc-Plan")]
	o := e.completerPlan
	e.plansMu.Unlock()
	if p == nil {
		p = &mcPlan{outcome: o}
	}
	return p
}

// charge is the fake gateway's PaymentIntent creation with the derived key.
func (e *mcEnv) charge(l *idemdriver.Lease, amount int) string {
	key := l.ChildKey("charge")
	g := e.gw
	g.mu.Lock()
	defer g.mu.Unlock()
	c := g.charges[key]
	if c == nil {
		c = &mcCharge{ID: fmt.Sprintf("pi_%d", len(g.charges)+1), Key: key, User: l.User, IKey: l.Key, CreatedAt: l.CreatedAt, Amount: amount}
		g.charges[key] = c
	} else if c.Amount != amount || c.User != l.User || c.IKey != l.Key {
		e.anomaly("gateway: derived key %s reused with other parameters: %+v, now %s/%s amount %d", key[:12], *c, l.User, l.Key, amount)
	}
	c.Calls++
	return c.ID
}

func (e *mcEnv) charges() map[string]mcCharge {
	e.gw.mu.Lock()
	defer e.gw.mu.Unlock()
	out := make(map[string]mcCharge, len(e.gw.charges))
	for k, c := range e.gw.charges {
		out[k] = *c
	}
	return out
}

// handle is the application handler behind the middleware: it refuses
// (400) before anything, or charges the gateway with the derived key and
// then fails (500), panics, or writes its execution row in the request's
// transaction and answers 201. A held plan blocks (before or after the
// charge, never in a transaction) until the model releases it.
func (e *mcEnv) handle(w http.ResponseWriter, r *http.Request) {
	l, ok := idem.LeaseFromContext(r.Context())
	if !ok {
		e.anomaly("handler ran without a lease")
		w.WriteHeader(http.StatusInternalServerError)
		return
	}
	body, _ := io.ReadAll(r.Body)
	var in struct{ Amount int }
	_ = json.Unmarshal(body, &in) // not JSON: amount 0, no variant
	variant := -1
	for v, a := range mcAmounts {
		if a == in.Amount {
			variant = v
		}
	}
	if variant < 0 {
		e.anomaly("handler got an unknown body %q", body)
		w.WriteHeader(http.StatusInternalServerError)
		return
	}
	p := e.planOf(r)
	attempt := fmt.Sprintf("a%d", e.attemptSeq.Add(1))
	p.mu.Lock()
	p.ran, p.lease, p.attempt, p.final = true, *l, attempt, p.outcome
	p.mu.Unlock()
	outcome := p.outcome
	charged := false
	if p.hold != mcNoHold {
		if p.hold == mcHoldAfterCharge {
			e.charge(l, in.Amount)
			charged = true
		}
		close(p.reached)
		outcome = <-p.release
		p.mu.Lock()
		p.final = outcome
		p.mu.Unlock()
	}
	if outcome == mcRefuse {
		if charged {
			e.anomaly("model: a refusal planned after a charge")
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, mcRefusedMsg)
		return
	}
	chargeID := e.charge(l, in.Amount)
	switch outcome {
	case mcFail:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusInternalServerError)
		io.WriteString(w, mcFailedMsg)
		return
	case mcPanic:
		panic("modelcheck: planned panic")
	}
	op := l.ChildKey("charge")
	out, _ := json.Marshal(map[string]any{"op": op, "attempt": attempt, "charge": chargeID, "user": l.User, "key": l.Key, "variant": variant})
	x := mcExec{Op: op, Attempt: attempt, User: l.User, Key: l.Key, Variant: variant, Status: http.StatusCreated,
		Body: string(out), CType: "application/json", Location: "/v1/orders/" + attempt}
	if err := e.writeExec(r.Context(), x); err != nil {
		e.anomaly("handler could not write its execution: %v", err)
		w.WriteHeader(http.StatusInternalServerError)
		return
	}
	h := w.Header()
	h.Set("Content-Type", x.CType)
	h.Set("Location", x.Location)
	h.Set("Set-Cookie", "mc="+attempt) // never stored
	h.Set("X-Mc-Attempt", attempt)     // not in the stored headers
	w.WriteHeader(http.StatusCreated)
	io.WriteString(w, x.Body)
}

// writeExec writes x in the request's transaction.
func (e *mcEnv) writeExec(ctx context.Context, x mcExec) error {
	const ins = `INSERT INTO mc_exec (op, attempt, usr, ikey, variant, status, body, ctype, location) VALUES `
	if e.mutant == mcMutantExecOutsideTx {
		switch e.fx.kind {
		case mcMem:
			e.memMu.Lock()
			defer e.memMu.Unlock()
			e.memExecs = append(e.memExecs, x)
			return nil
		case mcSQLite:
			_, err := e.sqlite.DB().ExecContext(ctx, ins+`(?, ?, ?, ?, ?, ?, ?, ?, ?)`, x.Op, x.Attempt, x.User, x.Key, x.Variant, x.Status, x.Body, x.CType, x.Location)
			return err
		default:
			_, err := e.fx.pool.Exec(ctx, ins+`($1, $2, $3, $4, $5, $6, $7, $8, $9)`, x.Op, x.Attempt, x.User, x.Key, x.Variant, x.Status, x.Body, x.CType, x.Location)
			return err
		}
	}
	switch e.fx.kind {
	case mcMem:
		tx, err := memstore.FromContext(ctx)
		if err != nil {
			return err
		}
		tx.OnCommit(func() {
			e.memMu.Lock()
			defer e.memMu.Unlock()
			e.memExecs = append(e.memExecs, x)
		})
		return nil
	case mcSQLite:
		tx, err := sqlitestore.FromContext(ctx)
		if err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, ins+`(?, ?, ?, ?, ?, ?, ?, ?, ?)`, x.Op, x.Attempt, x.User, x.Key, x.Variant, x.Status, x.Body, x.CType, x.Location)
		return err
	default:
		tx, err := pgstore.FromContext(ctx)
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, ins+`($1, $2, $3, $4, $5, $6, $7, $8, $9)`, x.Op, x.Attempt, x.User, x.Key, x.Variant, x.Status, x.Body, x.CType, x.Location)
		return err
	}
}

// execs reads the committed execution rows.
func (e *mcEnv) execs(ctx context.Context) ([]mcExec, error) {
	var out []mcExec
	switch e.fx.kind {
	case mcMem:
		e.memMu.Lock()
		out = append(out, e.memExecs...)
		e.memMu.Unlock()
	case mcSQLite:
		rows, err := e.sqlite.DB().QueryContext(ctx, `SELECT op, attempt, usr, ikey, variant, status, body, ctype, location FROM mc_exec`)
		if err != nil {
			return nil, err
		}
		out, err = mcScan(rows)
		if err != nil {
			return nil, err
		}
	default:
		rows, err := e.fx.pool.Query(ctx, `SELECT op, attempt, usr, ikey, variant, status, body, ctype, location FROM mc_exec`)
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		for rows.Next() {
			var x mcExec
			if err := rows.Scan(&x.Op, &x.Attempt, &x.User, &x.Key, &x.Variant, &x.Status, &x.Body, &x.CType, &x.Location); err != nil {
				return nil, err
			}
			out = append(out, x)
		}
		if err := rows.Err(); err != nil {
			return nil, err
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Attempt < out[j].Attempt })
	return out, nil
}

func mcScan(rows *sql.Rows) ([]mcExec, error) {
	defer rows.Close()
	var out []mcExec
	for rows.Next() {
		var x mcExec
		if err := rows.Scan(&x.Op, &x.Attempt, &x.User, &x.Key, &x.Variant, &x.Status, &x.Body, &x.CType, &x.Location); err != nil {
			return nil, err
		}
		out = append(out, x)
	}
	return out, rows.Err()
}

// send makes one request through the middleware, as a client would.
func (e *mcEnv) send(user, key, body string, plan *mcPlan) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, mcPath, bytes.NewReader([]byte(body)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("X-Mc-User", user)
	if plan != nil {
		req.Header.Set("X-Mc-Plan", plan.id)
		req = req.WithContext(context.WithValue(req.Context(), mcPlanKey{}, plan.id))
	}
	rec := httptest.NewRecorder()
	e.mw.ServeHTTP(rec, req)
	return rec
}

// get reads (user, key) from the store itself, without faults: nil when
// there is no live record.
func (e *mcEnv) get(ctx context.Context, user, key string) (*idemdriver.Record, error) {
	rec, err := e.raw.Get(ctx, user, key)
	if errors.Is(err, idem.ErrNotFound) {
		return nil, nil
	}
	return rec, err
}

// opOf is the operation a record names: its derived charge key.
func mcOpOf(rec *idemdriver.Record) string {
	return (&idemdriver.Lease{User: rec.User, Key: rec.Key, CreatedAt: rec.CreatedAt}).ChildKey("charge")
}
