package idem_test

// Tests of the holes found by the review of issue 8: each one ran a key
// twice, or held it, on the code before it.

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/problem"
	"github.com/idem-go/idem/storetest"
)

// An answer too large to keep is given in full once; its work commits
// once; every replay is the documented problem with the original status
// and Location, and the handler never runs again.
func TestOversizeAnswerRunsOnce(t *testing.T) {
	b := setup(t, idem.Options{MaxStoredBody: 10}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/v1/things/1")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `"`+strings.Repeat("x", 20)+`"`)
	})
	first := b.post(t, "k", `{}`)
	if first.status != http.StatusCreated || len(first.body) != 22 || first.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("first answer: %d len %d replayed=%q; want the full 201", first.status, len(first.body), first.header.Get("Idempotent-Replayed"))
	}
	for i := range 3 {
		r := b.post(t, "k", `{}`)
		wantProblem(t, r, http.StatusCreated, problem.ResponseNotStored)
		if r.header.Get("Idempotent-Replayed") != "true" || r.header.Get("Location") != "/v1/things/1" {
			t.Errorf("replay %d: replayed=%q Location=%q; want true and the original Location", i, r.header.Get("Idempotent-Replayed"), r.header.Get("Location"))
		}
		var p struct {
			OriginalStatus int `json:"original_status"`
			OriginalLength int `json:"original_length"`
		}
		if err := json.Unmarshal([]byte(r.body), &p); err != nil || p.OriginalStatus != 201 || p.OriginalLength != 22 {
			t.Errorf("replay %d: %s; want original_status 201 and original_length 22", i, r.body)
		}
	}
	if runs, effects := b.runs.Load(), b.effects.Load(); runs != 1 || effects != 1 {
		t.Errorf("runs = %d, effects = %d; want 1 and 1", runs, effects)
	}
	if got := b.metrics.OversizeBody.Load(); got != 1 {
		t.Errorf("OversizeBody = %d, want 1", got)
	}
}

// A body that two decoders read two ways is refused before its key is
// claimed: the key stays free for a well-formed request.
func TestRepeatedMemberNamesRefusedBeforeClaim(t *testing.T) {
	b := setup(t, idem.Options{}, created)
	for _, body := range []string{
		`{"currency":"EUR","Currency":"USD"}`,
		`{"Currency":"USD","currency":"EUR"}`,
		`{"items":[{"sku":"A","sku":"B"}]}`,
	} {
		wantProblem(t, b.post(t, "k", body), http.StatusBadRequest, problem.BadBody)
	}
	if got := b.runs.Load(); got != 0 {
		t.Fatalf("runs = %d, want 0", got)
	}
	if r := b.post(t, "k", `{"currency":"EUR"}`); r.status != http.StatusCreated {
		t.Fatalf("well-formed request on the same key: %d %s, want 201", r.status, r.body)
	}
}

// Once an attempt at a key has run the handler, a later attempt's 4xx
// keeps the key bound: the first attempt may have paid (its answer was a
// 502), and a retry must continue that operation, not start a new one.
func TestRefusalAfterFirstAttemptKeepsKey(t *testing.T) {
	var (
		mu      sync.Mutex
		answers = []int{http.StatusBadGateway, http.StatusBadRequest, http.StatusCreated}
		created []time.Time
	)
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		l, _ := idem.LeaseFromContext(r.Context())
		mu.Lock()
		status := answers[0]
		answers = answers[1:]
		created = append(created, l.CreatedAt)
		mu.Unlock()
		w.WriteHeader(status)
	})
	for i, want := range []int{http.StatusBadGateway, http.StatusBadRequest} {
		if r := b.post(t, "k", `{"a":1}`); r.status != want {
			t.Fatalf("attempt %d: %d, want %d", i+1, r.status, want)
		}
	}
	rec, err := b.store.Get(context.Background(), "", "k")
	if err != nil || rec.Response != nil || rec.Attempts != 2 {
		t.Fatalf("after a 400 on attempt 2: record %+v, %v; want the key bound, unanswered, 2 attempts", rec, err)
	}
	wantProblem(t, b.post(t, "k", `{"a":2}`), http.StatusUnprocessableEntity, problem.KeyMismatch)
	if r := b.post(t, "k", `{"a":1}`); r.status != http.StatusCreated {
		t.Fatalf("attempt 3: %d, want 201", r.status)
	}
	if len(created) != 3 || !created[1].Equal(created[0]) || !created[2].Equal(created[0]) {
		t.Errorf("operations seen by the handler: %v; want one (one creation time)", created)
	}
	if got := b.metrics.Released.Load(); got != 0 {
		t.Errorf("Released = %d, want 0", got)
	}
}

// A refusal on the key's first attempt still frees it.
func TestRefusalOnFirstAttemptFreesKey(t *testing.T) {
	var n atomic.Int64
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	if r := b.post(t, "k", `{"a":1}`); r.status != http.StatusBadRequest {
		t.Fatalf("first: %d, want 400", r.status)
	}
	if r := b.post(t, "k", `{"a":2}`); r.status != http.StatusCreated {
		t.Fatalf("corrected request on the freed key: %d, want 201", r.status)
	}
}

// flakyStore fails chosen calls of the store it wraps, before or after
// passing them on: a call that fails after reaching the store is one whose
// answer was lost with the connection.
type flakyStore struct {
	idem.Store
	mu    sync.Mutex
	fails map[string][]bool // per operation, in order: true = fail after the call, false = before
	calls map[string]int
}

var errConnLost = errors.New("connection lost")

func (f *flakyStore) fault(op string) (fail, after bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls[op]++
	if len(f.fails[op]) == 0 {
		return false, false
	}
	after = f.fails[op][0]
	f.fails[op] = f.fails[op][1:]
	return true, after
}

func (f *flakyStore) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	fail, after := f.fault("claim")
	if fail && !after {
		return idemdriver.Claim{}, errConnLost
	}
	c, err := f.Store.Claim(ctx, p)
	if fail {
		return idemdriver.Claim{}, errConnLost
	}
	return c, err
}

func (f *flakyStore) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	if fail, _ := f.fault("begin"); fail {
		return nil, errConnLost
	}
	return f.Store.Begin(ctx, l)
}

func (f *flakyStore) Fail(ctx context.Context, l *idemdriver.Lease) error {
	fail, after := f.fault("fail")
	if fail && !after {
		return errConnLost
	}
	err := f.Store.Fail(ctx, l)
	if fail {
		return errConnLost
	}
	return err
}

func (f *flakyStore) Release(ctx context.Context, l *idemdriver.Lease) error {
	fail, after := f.fault("release")
	if fail && !after {
		return errConnLost
	}
	err := f.Store.Release(ctx, l)
	if fail {
		return errConnLost
	}
	return err
}

// A database blip must not hold a key: a claim whose answer was lost is
// sent again and finds its own lease, and a Fail or Release that could not
// reach the store is sent again, so the next request runs at once; a
// Begin that failed is sent again rather than failing the request.
func TestStoreBlipHoldsNoKey(t *testing.T) {
	flaky := &flakyStore{calls: map[string]int{}, fails: map[string][]bool{
		"claim":   {true, false, true},
		"begin":   {false},
		"fail":    {false, true},
		"release": {false, true},
	}}
	var status atomic.Int64
	status.Store(http.StatusCreated)
	b := setupStore(t, memstore.New(memstore.Options{}), func(s idem.Store) idem.Store { flaky.Store = s; return flaky },
		idem.Options{User: idem.SharedKeySpace, Lease: time.Hour}, func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(int(status.Load())) })

	// Claim: committed, answer lost; sent again, it finds its own lease.
	if r := b.post(t, "claimed", `{}`); r.status != http.StatusCreated || b.runs.Load() != 1 {
		t.Fatalf("claim whose answer was lost: %d %s, runs %d; want 201 at once, one run", r.status, r.body, b.runs.Load())
	}
	// Claim: failed before reaching the store, then committed and lost.
	if r := b.post(t, "claimed-2", `{}`); r.status != http.StatusCreated || b.runs.Load() != 2 {
		t.Fatalf("claim failing twice: %d %s, runs %d; want 201, one more run", r.status, r.body, b.runs.Load())
	}
	// Fail: lost before and after reaching the store; the lease still ends now.
	status.Store(http.StatusBadGateway)
	for range 2 {
		if r := b.post(t, "failed", `{}`); r.status != http.StatusBadGateway {
			t.Fatalf("failing request: %d %s, want the handler's 502 (not 409: the lease ended)", r.status, r.body)
		}
	}
	// Release: lost before and after; the key is free for another body.
	status.Store(http.StatusBadRequest)
	for _, body := range []string{`{"a":1}`, `{"a":2}`} {
		if r := b.post(t, "refused", body); r.status != http.StatusBadRequest {
			t.Fatalf("refused request %s: %d %s, want the handler's 400 (the key freed)", body, r.status, r.body)
		}
	}
	if got := b.metrics.StoreRetries.Load(); got != 8 {
		t.Errorf("StoreRetries = %d, want 8 (claims 3, begin 1, fails 2, releases 2)", got)
	}
}

// A key whose TTL runs out while its attempt still runs is not taken by a
// new operation: the retry is 409, the attempt commits, and later retries
// replay its answer. (orders serve with --key-ttl 2s --key-lease 10s and a
// gateway answering in 3 s paid twice before. The middleware now refuses
// a lease not shorter than the TTL, but an attempt that claims the key
// late in its life still holds it past created+TTL: here the second
// attempt, after a 5xx, claims at 1.4 s with a 1.5 s lease and a 2 s TTL.)
func TestExpiryDuringAttemptRunsOnce(t *testing.T) {
	clk := storetest.NewClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	inHandler, release := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	b := setupStore(t, memstore.New(memstore.Options{Now: clk.Now}), nil, idem.Options{TTL: 2 * time.Second, Lease: 1500 * time.Millisecond},
		func(w http.ResponseWriter, r *http.Request) {
			switch calls.Add(1) {
			case 1:
				w.WriteHeader(http.StatusBadGateway) // the key stays bound, its lease ends
				return
			case 2:
				close(inHandler)
				<-release // the gateway's 3 s
			}
			created(w, r)
		})
	if r := b.post(t, "k", `{"n":1}`); r.status != http.StatusBadGateway {
		t.Fatalf("first attempt: %d %s, want 502", r.status, r.body)
	}
	clk.Advance(1400 * time.Millisecond)
	done := make(chan result, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, b.srv.URL+"/v1/things", strings.NewReader(`{"n":1}`))
		req.Header.Set("Idempotency-Key", "k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- result{status: -1, body: err.Error()}
			return
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		done <- result{resp.StatusCode, resp.Header, string(body)}
	}()
	<-inHandler
	clk.Advance(1100 * time.Millisecond) // 2.5 s: past created+TTL, within the second attempt's lease
	wantProblem(t, b.post(t, "k", `{"n":1}`), http.StatusConflict, problem.InFlight)
	wantProblem(t, b.post(t, "k", `{"n":2}`), http.StatusUnprocessableEntity, problem.KeyMismatch)
	clk.Advance(300 * time.Millisecond)
	close(release)
	firstAnswer := <-done
	if firstAnswer.status != http.StatusCreated {
		t.Fatalf("the second attempt: %d %s, want 201", firstAnswer.status, firstAnswer.body)
	}
	clk.Advance(time.Second) // past created+TTL: the answer is kept a TTL from its completion
	r := b.post(t, "k", `{"n":1}`)
	if r.status != http.StatusCreated || r.body != firstAnswer.body || r.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry after the late completion: %d %s replayed=%q; want the first answer replayed", r.status, r.body, r.header.Get("Idempotent-Replayed"))
	}
	if runs, effects := b.runs.Load(), b.effects.Load(); runs != 2 || effects != 1 {
		t.Errorf("runs = %d, effects = %d; want 2 (the 502 and the 201) and 1", runs, effects)
	}
}

// A goroutine the handler leaves running gets no transaction once the
// request is answered, and the error is not ErrNoTx, which code reads as
// "not an idempotent request, write on your own".
func TestTxFromContextAfterAnswer(t *testing.T) {
	late := make(chan error, 1)
	answered := make(chan struct{}) // closed once the client has the answer
	var answerOnce sync.Once
	answer := func() { answerOnce.Do(func() { close(answered) }) }
	defer answer() // the goroutine ends even if the test fails first
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context() // the handler itself never begins its transaction
		go func() {
			<-answered
			_, err := idem.TxFromContext(ctx)
			late <- err
		}()
		w.WriteHeader(http.StatusServiceUnavailable)
	})
	srv := httptest.NewServer(idem.Middleware(memstore.New(memstore.Options{}), idem.Options{User: idem.SharedKeySpace})(h))
	defer srv.Close()
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "k")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	answer()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("status %d, want the handler's 503", resp.StatusCode)
	}
	select {
	case err := <-late:
		if !errors.Is(err, idem.ErrSettled) || errors.Is(err, idem.ErrNoTx) {
			t.Errorf("TxFromContext after the answer: %v; want ErrSettled, not ErrNoTx", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the late goroutine did not report")
	}
}

// A kept header no store can keep exactly (NUL, or bytes that are not
// UTF-8) does not fail the commit or change on replay: the answer is kept
// as one too large to keep is, and the handler never runs twice.
func TestUnkeepableHeaderRunsOnce(t *testing.T) {
	// (NUL, which Go's client refuses to read, is tested against
	// PostgreSQL over a raw socket in pgstore.)
	for name, link := range map[string]string{"not utf-8": "</a\xffb>"} {
		t.Run(name, func(t *testing.T) {
			b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Link", link)
				w.Header().Set("Location", "/v1/things/1")
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, `{}`)
			})
			if r := b.post(t, "k", `{}`); r.status != http.StatusCreated {
				t.Fatalf("first: %d %s", r.status, r.body)
			}
			r := b.post(t, "k", `{}`)
			wantProblem(t, r, http.StatusCreated, problem.ResponseNotStored)
			if r.header.Get("Location") != "/v1/things/1" || r.header.Get("Link") != "" {
				t.Errorf("replay headers: Location %q, Link %q; want the Location alone", r.header.Get("Location"), r.header.Get("Link"))
			}
			if got := b.runs.Load(); got != 1 {
				t.Errorf("runs = %d, want 1", got)
			}
		})
	}
}

// failingStore fails every claim.
type failingStore struct{ idem.Store }

func (failingStore) Claim(context.Context, idemdriver.ClaimParams) (idemdriver.Claim, error) {
	return idemdriver.Claim{}, errConnLost
}

// The middleware's logs name a key by an id, never the key itself (a
// client may make keys of private data). (Issue 10, point 6.)
func TestLogsNeverShowTheKey(t *testing.T) {
	var logs strings.Builder
	var mu sync.Mutex
	logger := slog.New(slog.NewTextHandler(lockedWriter{&mu, &logs}, nil))
	srv := httptest.NewServer(idem.Middleware(failingStore{memstore.New(memstore.Options{})}, idem.Options{User: idem.SharedKeySpace, Logger: logger})(http.HandlerFunc(created)))
	defer srv.Close()
	const key = "card-4242-4242-4242-4242"
	req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	mu.Lock()
	out := logs.String()
	mu.Unlock()
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(out, idemdriver.KeyID("", key)) {
		t.Fatalf("status %d, logs %q; want 503 and the claim failure logged with the key's id", resp.StatusCode, out)
	}
	if strings.Contains(out, key) {
		t.Errorf("logs show the key:\n%s", out)
	}
}
