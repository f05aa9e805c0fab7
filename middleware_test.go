package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/problem"
	"github.com/idem-go/idem/storetest"
)

// testBundle holds what a middleware test looks at.
type testBundle struct {
	srv     *httptest.Server
	store   *memstore.Store
	runs    atomic.Int64 // handler executions
	effects atomic.Int64 // committed effects
	metrics *idem.Metrics
}

// setup serves handler h behind the middleware. The handler commits one
// effect through the memstore transaction before answering.
func setup(t *testing.T, opts idem.Options, h func(w http.ResponseWriter, r *http.Request)) *testBundle {
	t.Helper()
	return setupStore(t, memstore.New(memstore.Options{}), nil, opts, h)
}

// setupStore is setup on ms, seen by the middleware through wrap(ms) when
// wrap is not nil.
func setupStore(t *testing.T, ms *memstore.Store, wrap func(idem.Store) idem.Store, opts idem.Options, h func(w http.ResponseWriter, r *http.Request)) *testBundle {
	t.Helper()
	b := &testBundle{store: ms, metrics: new(idem.Metrics)}
	var store idem.Store = ms
	if wrap != nil {
		store = wrap(ms)
	}
	opts.Metrics = b.metrics
	if opts.User == nil {
		opts.User = func(r *http.Request) string { return r.Header.Get("X-User") }
	}
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.runs.Add(1)
		if tx, err := memstore.FromContext(r.Context()); err == nil {
			tx.OnCommit(func() { b.effects.Add(1) })
		}
		h(w, r)
	})
	b.srv = httptest.NewServer(idem.Middleware(store, opts)(next))
	t.Cleanup(b.srv.Close)
	return b
}

func created(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/v1/things/1")
	w.Header().Set("X-Not-Stored", "1")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"echo":%s,"at":%d}`, body, time.Now().UnixNano())
}

type result struct {
	status int
	header http.Header
	body   string
}

func (b *testBundle) post(t *testing.T, key, body string, hdr ...string) result {
	t.Helper()
	r, err := b.tryPost(key, body, hdr...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// tryPost is post for any goroutine: it returns its error instead of
// failing the test.
func (b *testBundle) tryPost(key, body string, hdr ...string) (result, error) {
	req, err := http.NewRequest(http.MethodPost, b.srv.URL+"/v1/things", strings.NewReader(body))
	if err != nil {
		return result{}, err
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return result{}, fmt.Errorf("POST: %w", err)
	}
	defer resp.Body.Close()
	rb, _ := io.ReadAll(resp.Body)
	return result{resp.StatusCode, resp.Header, string(rb)}, nil
}

// goPost sends post from a goroutine of its own and gives its answer on
// the channel returned; an error comes as status -1 with the error as
// body, for the test's goroutine to fail on.
func (b *testBundle) goPost(key, body string, hdr ...string) <-chan result {
	ch := make(chan result, 1)
	go func() {
		r, err := b.tryPost(key, body, hdr...)
		if err != nil {
			r = result{status: -1, body: err.Error()}
		}
		ch <- r
	}()
	return ch
}

// inFlightSignal is a store that closes inFlight the first time a claim
// is answered ErrInFlight: a repeat is then waiting on the running
// attempt.
type inFlightSignal struct {
	idem.Store
	once     sync.Once
	inFlight chan struct{}
}

func newInFlightSignal(s idem.Store) *inFlightSignal {
	return &inFlightSignal{Store: s, inFlight: make(chan struct{})}
}

func (s *inFlightSignal) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	c, err := s.Store.Claim(ctx, p)
	if errors.Is(err, idem.ErrInFlight) {
		s.once.Do(func() { close(s.inFlight) })
	}
	return c, err
}

func wantProblem(t *testing.T, r result, status int, typ string) {
	t.Helper()
	if r.status != status {
		t.Fatalf("status = %d, want %d (body %s)", r.status, status, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Errorf("Content-Type = %q, want application/problem+json", ct)
	}
	var p struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
	}
	if err := json.Unmarshal([]byte(r.body), &p); err != nil {
		t.Fatalf("problem body %q: %v", r.body, err)
	}
	if p.Type != typ || p.Status != status || p.Title == "" || p.Detail == "" {
		t.Errorf("problem = %+v, want type %s status %d with title and detail", p, typ, status)
	}
}

func TestReplay(t *testing.T) {
	b := setup(t, idem.Options{}, created)
	first := b.post(t, "k1", `{"a":1,"b":2}`)
	if first.status != http.StatusCreated || first.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("first: %d replayed=%q", first.status, first.header.Get("Idempotent-Replayed"))
	}
	for _, key := range []string{"k1", `"k1"`} {
		again := b.post(t, key, "{ \"b\":2, \"a\":1 }")
		if again.status != first.status || again.body != first.body {
			t.Fatalf("replay with key %s: %d %q, want %d %q", key, again.status, again.body, first.status, first.body)
		}
		for _, h := range []string{"Content-Type", "Location"} {
			if got, want := again.header.Get(h), first.header.Get(h); got != want {
				t.Errorf("replay %s = %q, want %q", h, got, want)
			}
		}
		if got := again.header.Get("Idempotent-Replayed"); got != "true" {
			t.Errorf("Idempotent-Replayed = %q, want true", got)
		}
		if got := again.header.Get("Idempotency-Key"); got != key {
			t.Errorf("echoed Idempotency-Key = %q, want %q", got, key)
		}
		if again.header.Get("X-Not-Stored") != "" {
			t.Errorf("header X-Not-Stored replayed, want only the headers of Options.StoredHeaders")
		}
	}
	if got := b.runs.Load(); got != 1 {
		t.Errorf("handler runs = %d, want 1", got)
	}
	if got := b.effects.Load(); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
}

func TestKeyRequiredAndInvalid(t *testing.T) {
	b := setup(t, idem.Options{}, created)
	wantProblem(t, b.post(t, "", `{}`), http.StatusBadRequest, problem.KeyMissing)
	for _, key := range []string{`"unterminated`, "a b", strings.Repeat("x", 256), `"a\x"`} {
		r := b.post(t, key, `{}`)
		wantProblem(t, r, http.StatusBadRequest, problem.KeyInvalid)
		if got := r.header.Get("Idempotency-Key"); got != key {
			t.Errorf("echo for invalid key = %q, want %q", got, key)
		}
	}
	if got := b.runs.Load(); got != 0 {
		t.Errorf("handler runs = %d, want 0", got)
	}

	opt := setup(t, idem.Options{OptionalKey: true}, created)
	for i := 0; i < 2; i++ {
		if r := opt.post(t, "", `{}`); r.status != http.StatusCreated {
			t.Fatalf("optional key, no key: %d", r.status)
		}
	}
	if got := opt.runs.Load(); got != 2 {
		t.Errorf("unprotected runs = %d, want 2", got)
	}
}

func TestMismatch(t *testing.T) {
	b := setup(t, idem.Options{}, created)
	b.post(t, "k", `{"a":1}`)
	r := b.post(t, "k", `{"a":2}`)
	wantProblem(t, r, http.StatusUnprocessableEntity, problem.KeyMismatch)
	if got := b.runs.Load(); got != 1 {
		t.Errorf("handler runs = %d, want 1", got)
	}
}

func TestInFlight(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		<-release
		created(w, r)
	})
	done := b.goPost("k", `{}`)
	<-entered
	start := time.Now()
	r := b.post(t, "k", `{}`)
	elapsed := time.Since(start)
	wantProblem(t, r, http.StatusConflict, problem.InFlight)
	if r.header.Get("Retry-After") != "1" {
		t.Errorf("Retry-After = %q, want 1", r.header.Get("Retry-After"))
	}
	t.Logf("409 answered in %v", elapsed)
	close(release)
	if first := <-done; first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
}

func TestInFlightWait(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{}, 1)
	ms := memstore.New(memstore.Options{})
	signal := newInFlightSignal(ms)
	b := setupStore(t, ms, func(idem.Store) idem.Store { return signal }, idem.Options{InFlightWait: 5 * time.Second}, func(w http.ResponseWriter, r *http.Request) {
		entered <- struct{}{}
		<-release
		created(w, r)
	})
	done := b.goPost("k", `{}`)
	<-entered
	waiter := b.goPost("k", `{}`)
	<-signal.inFlight // the repeat was told in flight: it waits
	close(release)
	first, second := <-done, <-waiter
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	if second.status != http.StatusCreated || second.body != first.body || second.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("waiting repeat: %d %q, want the first's replay %q", second.status, second.body, first.body)
	}

	// The first attempt holds its key until the repeat's wait (100 ms of
	// real time, the wait exercised) ran out.
	shortEntered, shortRelease := make(chan struct{}), make(chan struct{})
	short := setup(t, idem.Options{InFlightWait: 100 * time.Millisecond}, func(w http.ResponseWriter, r *http.Request) {
		close(shortEntered)
		<-shortRelease
		created(w, r)
	})
	var releaseOnce sync.Once
	free := func() { releaseOnce.Do(func() { close(shortRelease) }) }
	defer free() // the held request ends even if the test fails first
	bg := short.goPost("k", `{}`)
	<-shortEntered
	start := time.Now()
	wantProblem(t, short.post(t, "k", `{}`), http.StatusConflict, problem.InFlight)
	if d := time.Since(start); d < 90*time.Millisecond {
		t.Errorf("409 after %v, want after the wait (100ms)", d)
	}
	free()
	if r := <-bg; r.status != http.StatusCreated {
		t.Errorf("the held request: %d %s, want 201", r.status, r.body)
	}
}

func TestRefusedRequestFreesKey(t *testing.T) {
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if strings.Contains(string(body), "bad") {
			http.Error(w, "bad", http.StatusBadRequest)
			return
		}
		created(w, r)
	})
	if r := b.post(t, "k", `{"v":"bad"}`); r.status != http.StatusBadRequest {
		t.Fatalf("bad request: %d", r.status)
	}
	if got := b.effects.Load(); got != 0 {
		t.Errorf("effects after a refused request = %d, want 0", got)
	}
	// The corrected request reuses the key.
	if r := b.post(t, "k", `{"v":"good"}`); r.status != http.StatusCreated {
		t.Fatalf("corrected request: %d %s", r.status, r.body)
	}
}

func TestServerErrorKeepsFingerprint(t *testing.T) {
	var fail atomic.Bool
	fail.Store(true)
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		if fail.Load() {
			http.Error(w, "boom", http.StatusBadGateway)
			return
		}
		created(w, r)
	})
	if r := b.post(t, "k", `{"a":1}`); r.status != http.StatusBadGateway {
		t.Fatalf("first: %d", r.status)
	}
	if got := b.effects.Load(); got != 0 {
		t.Errorf("effects after 5xx = %d, want 0", got)
	}
	wantProblem(t, b.post(t, "k", `{"a":2}`), http.StatusUnprocessableEntity, problem.KeyMismatch)
	if r := b.post(t, "k", `{"a":1}`); r.status != http.StatusBadGateway {
		t.Fatalf("same request again at once: %d, want it to run again", r.status)
	}
	fail.Store(false)
	if r := b.post(t, "k", `{"a":1}`); r.status != http.StatusCreated {
		t.Fatalf("after recovery: %d", r.status)
	}
	if got, want := b.runs.Load(), int64(3); got != want {
		t.Errorf("runs = %d, want %d", got, want)
	}
}

func TestPanicKeepsFingerprint(t *testing.T) {
	var calls atomic.Int64
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			panic("boom")
		}
		created(w, r)
	})
	wantProblem(t, b.post(t, "k", `{"a":1}`), http.StatusInternalServerError, problem.Internal)
	wantProblem(t, b.post(t, "k", `{"a":2}`), http.StatusUnprocessableEntity, problem.KeyMismatch)
	if r := b.post(t, "k", `{"a":1}`); r.status != http.StatusCreated {
		t.Fatalf("retry after panic: %d", r.status)
	}
	if got := b.effects.Load(); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
}

func TestPaymentRequiredIsStored(t *testing.T) {
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusPaymentRequired)
		io.WriteString(w, `{"status":402}`)
	})
	b.post(t, "k", `{}`)
	r := b.post(t, "k", `{}`)
	if r.status != http.StatusPaymentRequired || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("repeat of a 402: %d replayed=%q", r.status, r.header.Get("Idempotent-Replayed"))
	}
	if got := b.runs.Load(); got != 1 {
		t.Errorf("runs = %d, want 1", got)
	}
}

func TestRequestTooLarge(t *testing.T) {
	b := setup(t, idem.Options{MaxRequestBody: 16}, created)
	wantProblem(t, b.post(t, "k", strings.Repeat("x", 17)), http.StatusRequestEntityTooLarge, problem.RequestTooLarge)
	if r := b.post(t, "k", `{}`); r.status != http.StatusCreated {
		t.Fatalf("after 413 the key is free: %d", r.status)
	}
}

func TestUserScope(t *testing.T) {
	b := setup(t, idem.Options{}, created)
	a := b.post(t, "k", `{"who":"a"}`, "X-User", "alice")
	c := b.post(t, "k", `{"who":"b"}`, "X-User", "bob")
	if a.status != http.StatusCreated || c.status != http.StatusCreated || a.body == c.body {
		t.Fatalf("alice %d %s, bob %d %s: want two operations", a.status, a.body, c.status, c.body)
	}
	if r := b.post(t, "k", `{"who":"a"}`, "X-User", "bob"); r.status != http.StatusUnprocessableEntity {
		t.Errorf("bob with alice's body: %d, want 422 against bob's own record", r.status)
	}
}

// TestFencedAttemptAnswers409: an attempt that outlives its lease (on the
// store's fake clock) is taken over, and its late commit is fenced off.
func TestFencedAttemptAnswers409(t *testing.T) {
	clk := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	var calls atomic.Int64
	entered, release := make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	free := func() { releaseOnce.Do(func() { close(release) }) }
	defer free() // the slow attempt ends even if the test fails first
	b := setupStore(t, memstore.New(memstore.Options{Now: clk.Now}), nil, idem.Options{Lease: 200 * time.Millisecond, Now: clk.Now}, func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			close(entered)
			<-release // outlives its lease
		}
		created(w, r)
	})
	slow := b.goPost("k", `{}`)
	<-entered
	clk.Advance(400 * time.Millisecond) // past the slow attempt's lease
	fast := b.post(t, "k", `{}`)
	if fast.status != http.StatusCreated {
		t.Fatalf("takeover: %d", fast.status)
	}
	free() // the slow attempt commits after the takeover
	wantProblem(t, <-slow, http.StatusConflict, problem.InFlight)
	if got := b.effects.Load(); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
	if got := b.metrics.Fenced.Load(); got != 1 {
		t.Errorf("Fenced = %d, want 1", got)
	}
	if r := b.post(t, "k", `{}`); r.body != fast.body {
		t.Errorf("replay %q, want the owner's answer %q", r.body, fast.body)
	}
}

// waitingOwners is a store that closes all once want distinct attempts
// (owners) were answered ErrInFlight: that many repeats are waiting.
type waitingOwners struct {
	idem.Store
	want int
	all  chan struct{}

	mu     sync.Mutex // guards owners
	owners map[string]bool
}

func (s *waitingOwners) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	c, err := s.Store.Claim(ctx, p)
	if errors.Is(err, idem.ErrInFlight) {
		s.mu.Lock()
		if !s.owners[p.Owner] {
			s.owners[p.Owner] = true
			if len(s.owners) == s.want {
				close(s.all)
			}
		}
		s.mu.Unlock()
	}
	return c, err
}

// TestConcurrentDuplicates: of n concurrent duplicates one runs, while
// every other one waits for it (the handler holds the key until all n-1
// were told in flight), and all get its answer.
func TestConcurrentDuplicates(t *testing.T) {
	const n = 100
	ms := memstore.New(memstore.Options{})
	waiting := &waitingOwners{Store: ms, want: n - 1, all: make(chan struct{}), owners: map[string]bool{}}
	b := setupStore(t, ms, func(idem.Store) idem.Store { return waiting }, idem.Options{InFlightWait: 10 * time.Second}, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-waiting.all:
		case <-time.After(5 * time.Second): // a deadline, not a pause: the barrier is met in milliseconds
			waiting.mu.Lock()
			t.Errorf("after 5s, %d of the %d duplicates were told in flight", len(waiting.owners), n-1)
			waiting.mu.Unlock()
		}
		created(w, r)
	})
	var wg sync.WaitGroup
	bodies := make([]string, n)
	statuses := make([]int, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			r, err := b.tryPost("same", `{"n":1}`)
			if err != nil {
				r = result{status: -1, body: err.Error()}
			}
			bodies[i], statuses[i] = r.body, r.status
		}(i)
	}
	wg.Wait()
	for i := range bodies {
		if statuses[i] != http.StatusCreated || bodies[i] != bodies[0] {
			t.Fatalf("request %d: %d %q, want 201 %q", i, statuses[i], bodies[i], bodies[0])
		}
	}
	if got := b.runs.Load(); got != 1 {
		t.Errorf("runs = %d, want 1", got)
	}
}

func TestSafeMethodsPassThrough(t *testing.T) {
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	resp, err := http.Get(b.srv.URL + "/x")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("GET without key: %d, want 200", resp.StatusCode)
	}
}

func TestFlusherKept(t *testing.T) {
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		f, ok := w.(http.Flusher)
		if !ok {
			t.Errorf("ResponseWriter is not an http.Flusher")
			return
		}
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "part1 ")
		f.Flush()
		io.WriteString(w, "part2")
	})
	if r := b.post(t, "k", `{}`); r.body != "part1 part2" {
		t.Errorf("body %q", r.body)
	}
}

// reqCtxKey holds, in a request's context, the request's own context
// (see TestClientGoneDuringClaim).
type reqCtxKey struct{}

// clientGoneClaims makes the first claim last until the server has seen
// its client go: the request's own context, which the claim's context
// carries under reqCtxKey (without its cancellation), is done. entered
// receives a value (without waiting) as that claim begins.
type clientGoneClaims struct {
	idem.Store
	t       *testing.T
	entered chan struct{}
	waited  atomic.Bool
}

func (s *clientGoneClaims) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	if s.waited.CompareAndSwap(false, true) {
		select {
		case s.entered <- struct{}{}:
		default:
		}
		rctx, _ := ctx.Value(reqCtxKey{}).(context.Context)
		if rctx == nil {
			s.t.Error("the claim's context does not carry the request's values")
		} else {
			select {
			case <-rctx.Done():
			case <-time.After(10 * time.Second): // a deadline, not a pause: the client leaves at once
				s.t.Error("the server did not see the client go during the claim")
			}
		}
	}
	if err := ctx.Err(); err != nil {
		return idemdriver.Claim{}, err
	}
	return s.Store.Claim(ctx, p)
}

// TestClientGoneDuringClaim: a client that gives up while its claim is
// being made must not leave the key claimed and unrun for a whole lease;
// the request runs and its retry gets the answer.
func TestClientGoneDuringClaim(t *testing.T) {
	store := memstore.New(memstore.Options{})
	var runs atomic.Int64
	claims := &clientGoneClaims{Store: store, t: t, entered: make(chan struct{}, 1)}
	mw := idem.Middleware(claims, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		created(w, r)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mw.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), reqCtxKey{}, r.Context())))
	}))
	defer srv.Close()
	// The client gives up once its claim is being made (not on a timer,
	// which a loaded machine may spend before the request arrives).
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-claims.entered
		cancel()
	}()
	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL, strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "k")
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatal("the impatient client got an answer; want it gone")
	}
	// The request runs without its client, and its answer is stored.
	testwait.Until(t, 0, "the answer to be stored", func() bool {
		rec, err := store.Get(context.Background(), "", "k")
		return err == nil && rec.Response != nil
	})
	req, _ = http.NewRequest("POST", srv.URL, strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "k")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || resp.Header.Get("Idempotent-Replayed") != "true" || runs.Load() != 1 {
		t.Errorf("retry: %d replayed=%q runs=%d; want the first attempt's 201 replayed", resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), runs.Load())
	}
}
