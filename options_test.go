package idem_test

import (
	"context"
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
)

// apiPanic calls f and returns what it panicked with, as a string, or ""
// if it returned.
func apiPanic(f func()) (msg string) {
	defer func() {
		if v := recover(); v != nil {
			msg = fmt.Sprint(v)
			if msg == "" {
				msg = "(empty panic)"
			}
		}
	}()
	f()
	return ""
}

// TestMiddlewareChecksOptions: Middleware panics when it is built, not
// on a request, for a nil store and for each invalid option, with a
// message that names the field; valid options, zero values included,
// build without a panic.
func TestMiddlewareChecksOptions(t *testing.T) {
	ms := memstore.New(memstore.Options{})
	bad := []struct {
		name  string
		store idem.Store
		opts  idem.Options
		want  string // in the message
	}{
		{"nil store", nil, idem.Options{User: idem.SharedKeySpace}, "nil Store"},
		{"no User", ms, idem.Options{}, "Options.User"},
		{"negative TTL", ms, idem.Options{User: idem.SharedKeySpace, TTL: -time.Second}, "Options.TTL"},
		{"negative Lease", ms, idem.Options{User: idem.SharedKeySpace, Lease: -1}, "Options.Lease"},
		{"negative InFlightWait", ms, idem.Options{User: idem.SharedKeySpace, InFlightWait: -time.Millisecond}, "Options.InFlightWait"},
		{"negative MaxRequestBody", ms, idem.Options{User: idem.SharedKeySpace, MaxRequestBody: -1}, "Options.MaxRequestBody"},
		{"negative MaxStoredBody", ms, idem.Options{User: idem.SharedKeySpace, MaxStoredBody: -1 << 20}, "Options.MaxStoredBody"},
		{"empty stored header", ms, idem.Options{User: idem.SharedKeySpace, StoredHeaders: []string{"Content-Type", ""}}, "Options.StoredHeaders[1]"},
		{"stored header with a space", ms, idem.Options{User: idem.SharedKeySpace, StoredHeaders: []string{"Content Type"}}, "Options.StoredHeaders[0]"},
		{"kept header with a colon", ms, idem.Options{User: idem.SharedKeySpace, KeptRequestHeaders: []string{"X-Tenant:"}}, "Options.KeptRequestHeaders[0]"},
		{"kept header not ASCII", ms, idem.Options{User: idem.SharedKeySpace, KeptRequestHeaders: []string{"X-Tenänt"}}, "Options.KeptRequestHeaders[0]"},
	}
	for _, c := range bad {
		t.Run(c.name, func(t *testing.T) {
			msg := apiPanic(func() { idem.Middleware(c.store, c.opts) })
			if !strings.HasPrefix(msg, "idem.Middleware: ") || !strings.Contains(msg, c.want) {
				t.Fatalf("Middleware panicked with %q; want a message from idem.Middleware naming %s", msg, c.want)
			}
		})
	}
	byHeader := func(r *http.Request) string { return r.Header.Get("X-User") }
	good := []idem.Options{
		{User: idem.SharedKeySpace},
		{User: byHeader, TTL: time.Hour, Lease: time.Minute, InFlightWait: time.Second, MaxRequestBody: 1, MaxStoredBody: 1},
		{User: byHeader, StoredHeaders: []string{}, KeptRequestHeaders: []string{}},
		{User: byHeader, StoredHeaders: []string{"content-type", "X-Custom_1", "!#$%&'*+-.^_`|~"}, KeptRequestHeaders: []string{"X-Tenant"}},
		{User: byHeader, Now: func() time.Time { return time.Unix(0, 0) }},
	}
	for i, o := range good {
		if msg := apiPanic(func() { idem.Middleware(ms, o) }); msg != "" {
			t.Errorf("good[%d]: Middleware panicked with %q", i, msg)
		}
	}
}

// apiClock is a clock that moves only when told to.
type apiClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *apiClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }

func (c *apiClock) Add(d time.Duration) { c.mu.Lock(); c.now = c.now.Add(d); c.mu.Unlock() }

// apiCountingStore counts the claims that reach the store.
type apiCountingStore struct {
	idem.Store
	claims atomic.Int64
}

func (s *apiCountingStore) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	s.claims.Add(1)
	return s.Store.Claim(ctx, p)
}

// apiHeld serves, behind the middleware with opts, a handler whose first
// run holds its key until release is closed (the test's cleanup closes
// it too); started is closed once that run began.
type apiHeld struct {
	srv              *httptest.Server
	store            *apiCountingStore
	started, release chan struct{}
	closeOnce        sync.Once
}

func newAPIHeld(t *testing.T, opts idem.Options) *apiHeld {
	t.Helper()
	a := &apiHeld{store: &apiCountingStore{Store: memstore.New(memstore.Options{})},
		started: make(chan struct{}), release: make(chan struct{})}
	var once sync.Once
	a.srv = httptest.NewServer(idem.Middleware(a.store, opts)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		once.Do(func() { close(a.started) })
		<-a.release
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":1}`)
	})))
	t.Cleanup(a.srv.Close)
	t.Cleanup(a.free) // runs first: the held request ends before the server closes
	return a
}

func (a *apiHeld) free() { a.closeOnce.Do(func() { close(a.release) }) }

// post sends POST /v1/things with key k and gives its answer on the
// channel.
func (a *apiHeld) post() <-chan result {
	ch := make(chan result, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, a.srv.URL+"/v1/things", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			ch <- result{status: -1, body: err.Error()}
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		ch <- result{resp.StatusCode, resp.Header, string(b)}
	}()
	return ch
}

// apiRecv returns the answer on ch, failing after 10 s.
func apiRecv(t *testing.T, what string, ch <-chan result) result {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(10 * time.Second):
		t.Fatalf("no answer to %s within 10 s", what)
		return result{}
	}
}

// TestNowGovernsInFlightWait: the end of Options.InFlightWait is read
// on Options.Now. The store keeps its own (real) clock, so the first
// attempt's lease holds throughout. With the middleware's clock standing
// still, a repeat keeps waiting long past InFlightWait of real time and
// gets the first attempt's answer once it is done; with the clock moved
// past InFlightWait, a waiting repeat is answered 409 at once.
func TestNowGovernsInFlightWait(t *testing.T) {
	for _, advance := range []bool{false, true} {
		t.Run(fmt.Sprintf("advance=%v", advance), func(t *testing.T) {
			clock := &apiClock{now: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)}
			wait := time.Millisecond
			if advance {
				wait = time.Hour
			}
			a := newAPIHeld(t, idem.Options{User: idem.SharedKeySpace, InFlightWait: wait, Now: clock.Now})
			first := a.post()
			<-a.started
			base := a.store.claims.Load()
			second := a.post()
			// The repeat claimed, was told in flight, and claimed again
			// after pauses of 5, 10, 20 and 40 ms: well past 1 ms of real
			// time.
			testwait.Until(t, 0, "the repeat to poll", func() bool { return a.store.claims.Load() >= base+5 })
			if advance {
				clock.Add(2 * time.Hour)
				r := apiRecv(t, "the repeat once the clock passed InFlightWait", second)
				wantProblem(t, r, http.StatusConflict, problem.InFlight)
				a.free()
				if r := apiRecv(t, "the first", first); r.status != http.StatusCreated {
					t.Fatalf("first: %d %s", r.status, r.body)
				}
				return
			}
			select {
			case r := <-second:
				t.Fatalf("repeat answered %d while the middleware's clock stood still", r.status)
			default:
			}
			a.free()
			if r := apiRecv(t, "the first", first); r.status != http.StatusCreated {
				t.Fatalf("first: %d %s", r.status, r.body)
			}
			r := apiRecv(t, "the repeat", second)
			if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" || r.body != `{"id":1}` {
				t.Fatalf("repeat: %d replayed=%q %s; want the first attempt's 201, replayed", r.status, r.header.Get("Idempotent-Replayed"), r.body)
			}
		})
	}
}

// TestDefaultErrorHandlerWithClock: with Options.Now set, the default
// ErrorHandler answers a repeat in flight with a 409 problem and
// Retry-After: 1 (never more than the rest of the lease, rounded up, and
// never less than one second), whether the middleware's clock is behind,
// level with or past the store's lease end.
func TestDefaultErrorHandlerWithClock(t *testing.T) {
	for _, off := range []time.Duration{-time.Hour, 0, 500 * time.Millisecond, 29 * time.Second, time.Hour} {
		t.Run(off.String(), func(t *testing.T) {
			clock := &apiClock{now: time.Now().Add(off)}
			a := newAPIHeld(t, idem.Options{User: idem.SharedKeySpace, Now: clock.Now})
			first := a.post()
			<-a.started
			r := apiRecv(t, "the repeat", a.post())
			wantProblem(t, r, http.StatusConflict, problem.InFlight)
			if got := r.header.Get("Retry-After"); got != "1" {
				t.Errorf("Retry-After = %q, want 1", got)
			}
			a.free()
			if r := apiRecv(t, "the first", first); r.status != http.StatusCreated {
				t.Fatalf("first: %d %s", r.status, r.body)
			}
		})
	}
}
