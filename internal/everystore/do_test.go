package everystore_test

// idem.Do (issue 14): the middleware's protocol without HTTP, on every
// store, with real goroutines; leases pass on the stores' fake clock.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
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
)

// doQuiet is a logger for the operations whose panics and failures the
// tests cause on purpose.
var doQuiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// inFlightCounter is a store that tells, by closing all, once n
// attempts (owners) were each answered ErrInFlight at least once.
type inFlightCounter struct {
	idem.Store
	n      int64
	seen   sync.Map // owner → true
	count  atomic.Int64
	all    chan struct{}
	closed sync.Once
}

func (s *inFlightCounter) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	c, err := s.Store.Claim(ctx, p)
	if errors.Is(err, idem.ErrInFlight) {
		if _, loaded := s.seen.LoadOrStore(p.Owner, true); !loaded && s.count.Add(1) == s.n {
			s.closed.Do(func() { close(s.all) })
		}
	}
	return c, err
}

// TestDoConcurrentCallsRunOnce: many goroutines call Do on one key at
// once: the function runs once, holding the key until every other call
// was told it is in flight and waits (InFlightWait); its write commits
// once, and every call gets its output.
func TestDoConcurrentCallsRunOnce(t *testing.T) {
	forDoKinds(t, func(t *testing.T, k *doKit) {
		ctx := context.Background()
		const n = 24
		s := &inFlightCounter{Store: k.store, n: n - 1, all: make(chan struct{})}
		p := doParams("msg-once", "test.once", `{"order":"ord_1"}`)
		p.InFlightWait = time.Minute // by the wall clock; the holder finishes long before
		var runs atomic.Int64
		results := make([]idem.DoResult, n)
		errs := make([]error, n)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				<-start
				results[i], errs[i] = idem.Do(ctx, s, p, func(ctx context.Context, input []byte) ([]byte, error) {
					runs.Add(1)
					if string(input) != `{"order":"ord_1"}` {
						return nil, fmt.Errorf("input %q", input)
					}
					// SQLite has one writer per process: a transaction held
					// open would keep the others' claims waiting, so the
					// write comes after the wait there.
					if k.kind != "sqlite" {
						if err := k.write(ctx, "once"); err != nil {
							return nil, err
						}
					}
					select {
					case <-s.all:
					case <-time.After(30 * time.Second):
						return nil, fmt.Errorf("only %d other calls were told in flight", s.count.Load())
					}
					if k.kind == "sqlite" {
						if err := k.write(ctx, "once"); err != nil {
							return nil, err
						}
					}
					return doOutput(fmt.Sprint(i)), nil
				})
			})
		}
		close(start)
		wg.Wait()
		var want []byte
		fresh := 0
		for i, err := range errs {
			if err != nil {
				t.Fatalf("call %d: %v", i, err)
			}
			if !results[i].Replayed {
				fresh++
				want = results[i].Output
			}
		}
		if fresh != 1 || runs.Load() != 1 {
			t.Fatalf("%d calls not replayed, %d runs; want 1 and 1", fresh, runs.Load())
		}
		for i, r := range results {
			if !bytes.Equal(r.Output, want) {
				t.Errorf("call %d: output %s, want %s", i, r.Output, want)
			}
		}
		if got := k.count(t, "once"); got != 1 {
			t.Errorf("committed writes = %d, want 1", got)
		}
		if got := s.count.Load(); got != n-1 {
			t.Errorf("%d calls waited in flight, want %d", got, n-1)
		}
	})
}

// TestDoCrashedAttemptIsFenced: an attempt hangs past its lease (its
// instance paused, or cut off); another takes the key over and completes
// it; when the first wakes up its Complete is fenced and its writes roll
// back. On the SQL stores the first attempt hangs with its transaction
// open (PostgreSQL), or before it (SQLite, whose one writer per process
// would keep the takeover's claim waiting).
func TestDoCrashedAttemptIsFenced(t *testing.T) {
	forDoKinds(t, func(t *testing.T, k *doKit) {
		ctx := context.Background()
		p := doParams("msg-crash", "test.crash", "input")
		holdsTx := k.kind != "sqlite"
		entered, resume := make(chan struct{}), make(chan struct{})
		type outcome struct {
			res idem.DoResult
			err error
		}
		first := make(chan outcome, 1)
		go func() {
			res, err := idem.Do(ctx, k.store, p, func(ctx context.Context, _ []byte) ([]byte, error) {
				if holdsTx {
					if err := k.write(ctx, "crash-first"); err != nil {
						close(entered)
						return nil, err
					}
				}
				close(entered)
				<-resume
				if !holdsTx {
					if err := k.write(ctx, "crash-first"); err != nil {
						return nil, err
					}
				}
				return doOutput("first"), nil
			})
			first <- outcome{res, err}
		}()
		<-entered
		notRun := func(context.Context, []byte) ([]byte, error) {
			t.Error("the function ran while another attempt held the key")
			return nil, nil
		}
		_, err := idem.Do(ctx, k.store, p, notRun)
		var ife *idem.InFlightError
		if !errors.Is(err, idem.ErrInFlight) || !errors.As(err, &ife) {
			t.Fatalf("Do while the first attempt holds the key: %v, want ErrInFlight", err)
		}
		k.clk.Advance(p.Lease + time.Second)
		res, err := idem.Do(ctx, k.store, p, func(ctx context.Context, _ []byte) ([]byte, error) {
			if l, ok := idem.LeaseFromContext(ctx); !ok || l.Attempt != 2 {
				return nil, fmt.Errorf("lease %+v, %v; want attempt 2", l, ok)
			}
			if err := k.write(ctx, "crash-second"); err != nil {
				return nil, err
			}
			return doOutput("second"), nil
		})
		if err != nil || res.Replayed || !bytes.Equal(res.Output, doOutput("second")) {
			t.Fatalf("takeover = %+v (%s), %v; want the second run's output", res, res.Output, err)
		}
		close(resume)
		if o := <-first; !errors.Is(o.err, idem.ErrFenced) {
			t.Fatalf("first attempt after the takeover = %+v, %v; want ErrFenced", o.res, o.err)
		}
		if got := k.count(t, "crash-first"); got != 0 {
			t.Errorf("fenced attempt's writes = %d, want 0", got)
		}
		if got := k.count(t, "crash-second"); got != 1 {
			t.Errorf("takeover's writes = %d, want 1", got)
		}
		res, err = idem.Do(ctx, k.store, p, notRun)
		if err != nil || !res.Replayed || !bytes.Equal(res.Output, doOutput("second")) {
			t.Errorf("repeat = %+v (%s), %v; want the second run's output, replayed", res, res.Output, err)
		}
	})
}

// TestDoErrorThenRetry: a function's error or panic rolls its writes back
// and ends the attempt at once, the key staying bound to its operation
// and input: the same call runs it again at once, another input is
// refused.
func TestDoErrorThenRetry(t *testing.T) {
	forDoKinds(t, func(t *testing.T, k *doKit) {
		ctx := context.Background()
		p := doParams("msg-retry", "test.retry", "input")
		var m idem.Metrics
		p.Metrics = &m
		_, err := idem.Do(ctx, k.store, p, func(ctx context.Context, _ []byte) ([]byte, error) {
			if err := k.write(ctx, "retry-1"); err != nil {
				return nil, err
			}
			return nil, fmt.Errorf("charging: %w", errDoBoom)
		})
		if !errors.Is(err, errDoBoom) {
			t.Fatalf("failing Do = %v, want the function's error", err)
		}
		rec := doRecord(t, k, p)
		if rec.Response != nil || rec.Method != "" || rec.Path != "test.retry" || string(rec.Body) != "input" || rec.LeaseUntil.After(k.clk.Now()) {
			t.Errorf("record after the failure = %+v; want no response, Method empty, Path the operation, Body the input, lease ended", rec)
		}
		other := p
		other.Input = []byte("other input")
		if _, err := idem.Do(ctx, k.store, other, func(context.Context, []byte) ([]byte, error) {
			t.Error("the function ran for another input on a bound key")
			return nil, nil
		}); !errors.Is(err, idem.ErrFingerprintMismatch) {
			t.Errorf("another input on the failed key = %v, want ErrFingerprintMismatch", err)
		}
		_, err = idem.Do(ctx, k.store, p, func(ctx context.Context, _ []byte) ([]byte, error) {
			if err := k.write(ctx, "retry-2"); err != nil {
				return nil, err
			}
			panic("a bug in the function")
		})
		if !errors.Is(err, idem.ErrHandlerPanicked) {
			t.Fatalf("panicking Do = %v, want ErrHandlerPanicked", err)
		}
		attempt := 0
		res, err := idem.Do(ctx, k.store, p, func(ctx context.Context, _ []byte) ([]byte, error) {
			l, _ := idem.LeaseFromContext(ctx)
			attempt = l.Attempt
			if err := k.write(ctx, "retry-3"); err != nil {
				return nil, err
			}
			return doOutput("third"), nil
		})
		if err != nil || res.Replayed || !bytes.Equal(res.Output, doOutput("third")) || attempt != 3 {
			t.Fatalf("retry = %+v, %v, attempt %d; want the output, attempt 3", res, err, attempt)
		}
		for name, want := range map[string]int{"retry-1": 0, "retry-2": 0, "retry-3": 1} {
			if got := k.count(t, name); got != want {
				t.Errorf("writes %s = %d, want %d", name, got, want)
			}
		}
		if m.Executions.Load() != 3 || m.Failed.Load() != 2 || m.Completed.Load() != 1 || m.Mismatches.Load() != 1 {
			t.Errorf("metrics: %d executions, %d failed, %d completed, %d mismatches; want 3, 2, 1, 1",
				m.Executions.Load(), m.Failed.Load(), m.Completed.Load(), m.Mismatches.Load())
		}
	})
}

// TestDoFingerprint: a completed key replays for the same operation and
// input only; another input or another operation is refused, the
// function not called.
func TestDoFingerprint(t *testing.T) {
	forDoKinds(t, func(t *testing.T, k *doKit) {
		ctx := context.Background()
		p := doParams("msg-fp", "test.fp", `{"a":1,"b":2}`)
		out := func(context.Context, []byte) ([]byte, error) { return doOutput("fp"), nil }
		if _, err := idem.Do(ctx, k.store, p, out); err != nil {
			t.Fatal(err)
		}
		refused := func(context.Context, []byte) ([]byte, error) {
			t.Error("the function ran on a mismatch")
			return nil, nil
		}
		for _, q := range []idem.DoParams{
			doParams("msg-fp", "test.fp", `{"b":2,"a":1}`), // the same JSON: but Do hashes bytes as they are
			doParams("msg-fp", "test.fp", ``),
			doParams("msg-fp", "test.other", `{"a":1,"b":2}`),
			doParams("msg-fp", "test.f", `p{"a":1,"b":2}`), // operation and input are kept apart
		} {
			if _, err := idem.Do(ctx, k.store, q, refused); !errors.Is(err, idem.ErrFingerprintMismatch) {
				t.Errorf("Do(%s, %q) on a key completed for (%s, %q) = %v, want ErrFingerprintMismatch", q.Operation, q.Input, p.Operation, p.Input, err)
			}
		}
		q := p
		q.User = "consumer:another"
		if res, err := idem.Do(ctx, k.store, q, out); err != nil || res.Replayed {
			t.Errorf("the same key under another user = %+v, %v; want a run of its own", res, err)
		}
		if res, err := idem.Do(ctx, k.store, p, refused); err != nil || !res.Replayed || !bytes.Equal(res.Output, doOutput("fp")) {
			t.Errorf("repeat = %+v, %v; want the output replayed", res, err)
		}
	})
}

// TestDoAndHTTPNeverShareARecord: a Do record is never replayed to an
// HTTP request with the same user and key, and an HTTP record never to a
// Do call, even for the same path (operation) and body (input): each is
// refused as a mismatch.
func TestDoAndHTTPNeverShareARecord(t *testing.T) {
	forDoKinds(t, func(t *testing.T, k *doKit) {
		ctx := context.Background()
		var handlerRuns atomic.Int64
		h := idem.Middleware(k.store, idem.Options{User: func(*http.Request) string { return "consumer:test" }})(
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				handlerRuns.Add(1)
				if err := k.write(r.Context(), "http"); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				w.WriteHeader(http.StatusCreated)
			}))
		post := func(key string) int {
			r := httptest.NewRequest(http.MethodPost, "/v1/things", strings.NewReader(`{"n":1}`))
			r.Header.Set("Content-Type", "application/json")
			r.Header.Set("Idempotency-Key", key)
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			return w.Code
		}
		var doRuns atomic.Int64
		fn := func(ctx context.Context, _ []byte) ([]byte, error) {
			doRuns.Add(1)
			return doOutput("do"), k.write(ctx, "do")
		}
		// Do first, then HTTP.
		if _, err := idem.Do(ctx, k.store, doParams("shared-1", "/v1/things", `{"n":1}`), fn); err != nil {
			t.Fatal(err)
		}
		if code := post("shared-1"); code != http.StatusUnprocessableEntity {
			t.Errorf("HTTP request on a Do key = %d, want 422", code)
		}
		// HTTP first, then Do.
		if code := post("shared-2"); code != http.StatusCreated {
			t.Fatalf("HTTP request = %d, want 201", code)
		}
		if _, err := idem.Do(ctx, k.store, doParams("shared-2", "/v1/things", `{"n":1}`), fn); !errors.Is(err, idem.ErrFingerprintMismatch) {
			t.Errorf("Do on an HTTP key = %v, want ErrFingerprintMismatch", err)
		}
		if doRuns.Load() != 1 || handlerRuns.Load() != 1 || k.count(t, "do") != 1 || k.count(t, "http") != 1 {
			t.Errorf("Do ran %d times, the handler %d; writes do %d, http %d; want 1 each",
				doRuns.Load(), handlerRuns.Load(), k.count(t, "do"), k.count(t, "http"))
		}
	})
}

// kindsBlind is a SweepingStore whose Abandoned ignores
// AbandonedParams.Kinds, as a sweeper written before it does.
type kindsBlind struct{ idemdriver.SweepingStore }

func (s kindsBlind) Abandoned(ctx context.Context, p idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	p.Kinds = nil
	return s.SweepingStore.Abandoned(ctx, p)
}

// TestDoCompleterFinishesAbandoned: a completer with the function
// registered finishes a Do operation that failed and one whose attempt
// hung past its lease (which is then fenced), through Do, with the input
// its record keeps; an operation not registered is skipped without a
// claim, and an HTTP record is never given to a function, even one
// registered under its path.
func TestDoCompleterFinishesAbandoned(t *testing.T) {
	forDoKinds(t, func(t *testing.T, k *doKit) {
		ctx := context.Background()
		failed := doParams("abandoned-failed", "test.redrive", "input-failed")
		hung := doParams("abandoned-hung", "test.redrive", "input-hung")
		unknown := doParams("abandoned-unknown", "test.unknown", "input-unknown")
		if _, err := idem.Do(ctx, k.store, failed, func(context.Context, []byte) ([]byte, error) { return nil, errDoBoom }); !errors.Is(err, errDoBoom) {
			t.Fatalf("failing Do = %v", err)
		}
		if _, err := idem.Do(ctx, k.store, unknown, func(context.Context, []byte) ([]byte, error) { return nil, errDoBoom }); !errors.Is(err, errDoBoom) {
			t.Fatalf("failing Do = %v", err)
		}
		entered, resume := make(chan struct{}), make(chan struct{})
		hungErr := make(chan error, 1)
		go func() {
			_, err := idem.Do(ctx, k.store, hung, func(ctx context.Context, _ []byte) ([]byte, error) {
				close(entered)
				<-resume
				return doOutput("hung"), k.write(ctx, "hung")
			})
			hungErr <- err
		}()
		<-entered
		// An HTTP record, abandoned after a 5xx, whose path is a registered
		// operation's name.
		h := idem.Middleware(k.store, idem.Options{User: func(*http.Request) string { return "consumer:test" }})(
			http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusBadGateway) }))
		r := httptest.NewRequest(http.MethodPost, "/v1/redrive", strings.NewReader(`{}`))
		r.Header.Set("Idempotency-Key", "abandoned-http")
		h.ServeHTTP(httptest.NewRecorder(), r)

		k.clk.Advance(hung.Lease + time.Second)
		var inputs sync.Map
		var trapped atomic.Int64
		// A sweeper that knows nothing of AbandonedParams.Kinds (one
		// written before it) lists every kind: the completer itself still
		// skips what it does not run (the stores' own filter is the
		// storetest cases AbandonedKinds and DoRedriveNotStarved).
		c := idem.NewCompleter(kindsBlind{k.store}, nil, idem.CompleterOptions{
			Logger: doQuiet,
			Funcs: map[string]idem.DoFunc{
				"test.redrive": func(ctx context.Context, input []byte) ([]byte, error) {
					l, _ := idem.LeaseFromContext(ctx)
					inputs.Store(l.Key, string(input))
					return doOutput("completer:" + string(input)), k.write(ctx, "completer")
				},
				"/v1/redrive": func(context.Context, []byte) ([]byte, error) {
					trapped.Add(1)
					return nil, nil
				},
			},
		})
		st, err := c.RunOnce(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Scanned != 4 || st.Completed != 2 || st.Skipped != 2 || st.Failed != 0 {
			t.Errorf("scan = %+v; want 4 scanned, 2 completed, 2 skipped", st)
		}
		close(resume)
		if err := <-hungErr; !errors.Is(err, idem.ErrFenced) {
			t.Errorf("the hung attempt after the completer = %v, want ErrFenced", err)
		}
		if trapped.Load() != 0 {
			t.Error("an HTTP record was run through a DoFunc")
		}
		if got, want := k.count(t, "completer"), 2; got != want {
			t.Errorf("completer's writes = %d, want %d", got, want)
		}
		if got := k.count(t, "hung"); got != 0 {
			t.Errorf("fenced attempt's writes = %d, want 0", got)
		}
		for _, p := range []idem.DoParams{failed, hung} {
			if in, _ := inputs.Load(p.Key); in != string(p.Input) {
				t.Errorf("%s re-driven with input %v, want %q", p.Key, in, p.Input)
			}
			res, err := idem.Do(ctx, k.store, p, func(context.Context, []byte) ([]byte, error) {
				t.Error("the function ran again after the completer finished it")
				return nil, nil
			})
			if err != nil || !res.Replayed || !bytes.Equal(res.Output, doOutput("completer:"+string(p.Input))) {
				t.Errorf("%s after the completer = %+v (%s), %v; want the completer's output replayed", p.Key, res, res.Output, err)
			}
			if rec := doRecord(t, k, p); rec.Redrives != 1 || rec.Response == nil || rec.Response.Status != http.StatusOK {
				t.Errorf("%s: record %+v; want 1 re-drive and a stored output", p.Key, rec)
			}
		}
		if rec := doRecord(t, k, unknown); rec.Attempts != 1 || rec.Redrives != 0 || rec.Response != nil {
			t.Errorf("unregistered operation's record = %+v; want it untouched (1 attempt, 0 re-drives)", rec)
		}
		rec, err := k.store.Get(ctx, "consumer:test", "abandoned-http")
		if err != nil || rec.Attempts != 1 || rec.Redrives != 0 || rec.Response != nil {
			t.Errorf("HTTP record = %+v, %v; want it untouched", rec, err)
		}
	})
}

// TestDoCompleterCountsFailures: a registered function that fails or
// panics again counts as Failed, and the completers' last re-drive as
// GivenUp, as an HTTP re-drive's 5xx; a handler and functions together
// each get their own records.
func TestDoCompleterCountsFailures(t *testing.T) {
	ctx := context.Background()
	k := newDoKit(t, "mem")
	p := doParams("given-up", "test.flaky", "input")
	if _, err := idem.Do(ctx, k.store, p, func(context.Context, []byte) ([]byte, error) { return nil, errDoBoom }); !errors.Is(err, errDoBoom) {
		t.Fatalf("failing Do = %v", err)
	}
	// An abandoned HTTP request beside it.
	var handlerRuns atomic.Int64
	fail := true
	mo := idem.Options{User: idem.SharedKeySpace, Fingerprint: func(*http.Request, []byte) (string, error) { return "http-fp", nil }}
	next := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		handlerRuns.Add(1)
		if fail {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	r := httptest.NewRequest(http.MethodPost, "/v1/things", nil)
	r.Header.Set("Idempotency-Key", "http-abandoned")
	idem.Middleware(k.store, mo)(next).ServeHTTP(httptest.NewRecorder(), r)
	fail = false

	var m idem.Metrics
	mo.Metrics = &m
	runs := 0
	c := idem.NewCompleter(k.store, next, idem.CompleterOptions{
		MaxAttempts: 2, Backoff: time.Second, Middleware: mo,
		Logger: doQuiet,
		Funcs: map[string]idem.DoFunc{"test.flaky": func(context.Context, []byte) ([]byte, error) {
			runs++
			if runs == 1 {
				panic("flaky")
			}
			return nil, errDoBoom
		}},
	})
	st, err := c.RunOnce(ctx)
	if err != nil || st.Scanned != 2 || st.Failed != 1 || st.GivenUp != 0 || st.Completed != 1 {
		t.Fatalf("first scan = %+v, %v; want the panic Failed, the HTTP request Completed", st, err)
	}
	k.clk.Advance(time.Second)
	st, err = c.RunOnce(ctx)
	if err != nil || st.Scanned != 1 || st.Failed != 1 || st.GivenUp != 1 {
		t.Fatalf("second scan = %+v, %v; want 1 failed and given up", st, err)
	}
	if m.GivenUp.Load() != 1 {
		t.Errorf("Metrics.GivenUp = %d, want 1", m.GivenUp.Load())
	}
	k.clk.Advance(time.Hour)
	if st, err = c.RunOnce(ctx); err != nil || st.Scanned != 0 {
		t.Errorf("scan after giving up = %+v, %v; want nothing listed", st, err)
	}
	if rec := doRecord(t, k, p); rec.Redrives != 2 || rec.Response != nil {
		t.Errorf("record = %+v; want 2 re-drives, no outcome", rec)
	}
	if handlerRuns.Load() != 2 || runs != 2 {
		t.Errorf("handler ran %d times, the function %d; want 2 and 2", handlerRuns.Load(), runs)
	}
}

// TestDoRefusesBadParams: Do checks its params before it claims.
func TestDoRefusesBadParams(t *testing.T) {
	ctx := context.Background()
	s := memstore.New(memstore.Options{})
	fn := func(context.Context, []byte) ([]byte, error) {
		t.Error("the function ran with bad params")
		return nil, nil
	}
	good := doParams("k", "op", "")
	for _, c := range []struct {
		name   string
		change func(p *idem.DoParams)
		is     error
	}{
		{"empty user", func(p *idem.DoParams) { p.User = "" }, nil},
		{"user with NUL", func(p *idem.DoParams) { p.User = "a\x00b" }, nil},
		{"empty operation", func(p *idem.DoParams) { p.Operation = "" }, nil},
		{"operation too long", func(p *idem.DoParams) { p.Operation = strings.Repeat("o", idem.MaxKeyLength+1) }, nil},
		{"operation not UTF-8", func(p *idem.DoParams) { p.Operation = "op\xff" }, nil},
		{"empty key", func(p *idem.DoParams) { p.Key = "" }, idem.ErrKeyInvalid},
		{"key with a space", func(p *idem.DoParams) { p.Key = "a b" }, idem.ErrKeyInvalid},
		{"negative lease", func(p *idem.DoParams) { p.Lease = -time.Second }, nil},
		{"negative TTL", func(p *idem.DoParams) { p.TTL = -time.Second }, nil},
		{"lease not shorter than the TTL", func(p *idem.DoParams) { p.Lease, p.TTL = time.Minute, time.Minute }, nil},
		{"negative wait", func(p *idem.DoParams) { p.InFlightWait = -time.Second }, nil},
	} {
		p := good
		c.change(&p)
		_, err := idem.Do(ctx, s, p, fn)
		if err == nil || (c.is != nil && !errors.Is(err, c.is)) {
			t.Errorf("%s: Do = %v, want an error (matching %v)", c.name, err, c.is)
		}
	}
	done, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := idem.Do(done, s, good, fn); !errors.Is(err, context.Canceled) {
		t.Errorf("Do with a context already done = %v, want context.Canceled", err)
	}
	if _, err := idem.Do(ctx, nil, good, fn); err == nil {
		t.Error("Do with a nil store: no error")
	}
	if _, err := idem.Do(ctx, s, good, nil); err == nil {
		t.Error("Do with a nil function: no error")
	}
	if n := s.Len(); n != 0 {
		t.Errorf("bad params (or a done context) left %d records", n)
	}
	// A quoted key is read as ParseKey reads the header: the same key.
	q := good
	q.Key = `"k"`
	if _, err := idem.Do(ctx, s, good, func(context.Context, []byte) ([]byte, error) { return []byte("x"), nil }); err != nil {
		t.Fatal(err)
	}
	if res, err := idem.Do(ctx, s, q, fn); err != nil || !res.Replayed {
		t.Errorf("the quoted key = %+v, %v; want the bare key's output replayed", res, err)
	}
}

// TestDoContext: the function's context holds its lease and a
// transaction begun on first use; a function that writes nothing is
// completed all the same; a goroutine a failed function left behind can
// no longer begin a transaction.
func TestDoContext(t *testing.T) {
	ctx := context.Background()
	s := memstore.New(memstore.Options{})
	if _, err := idem.TxFromContext(ctx); !errors.Is(err, idem.ErrNoTx) {
		t.Errorf("TxFromContext outside Do = %v, want ErrNoTx", err)
	}
	p := doParams("ctx", "test.ctx", "")
	res, err := idem.Do(ctx, s, p, func(ctx context.Context, _ []byte) ([]byte, error) {
		l, ok := idem.LeaseFromContext(ctx)
		if !ok || l.User != p.User || l.Key != p.Key || l.Attempt != 1 {
			return nil, fmt.Errorf("lease %+v, %v", l, ok)
		}
		return nil, nil // writes nothing, outputs nothing
	})
	if err != nil || res.Replayed || len(res.Output) != 0 {
		t.Fatalf("Do = %+v, %v", res, err)
	}
	rec, err := s.Get(ctx, p.User, p.Key)
	if err != nil || rec.Response == nil || rec.Response.Status != http.StatusOK || len(rec.Response.Body) != 0 {
		t.Errorf("record = %+v, %v; want a stored empty output", rec, err)
	}
	var left context.Context
	q := doParams("ctx-failed", "test.ctx", "")
	if _, err := idem.Do(ctx, s, q, func(ctx context.Context, _ []byte) ([]byte, error) {
		left = ctx
		return nil, errDoBoom
	}); !errors.Is(err, errDoBoom) {
		t.Fatalf("failing Do = %v", err)
	}
	if _, err := idem.TxFromContext(left); !errors.Is(err, idem.ErrSettled) {
		t.Errorf("TxFromContext after a failed Do returned = %v, want ErrSettled", err)
	}
}
