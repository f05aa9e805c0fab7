package client_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem/client"
)

// recorder serves answers in order and remembers what it was sent.
type recorder struct {
	mu      sync.Mutex
	keys    []string
	bodies  []string
	answers []func(w http.ResponseWriter)
}

func (rec *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	rec.mu.Lock()
	n := len(rec.keys)
	rec.keys = append(rec.keys, r.Header.Get("Idempotency-Key"))
	rec.bodies = append(rec.bodies, string(b))
	answer := func(w http.ResponseWriter) { w.WriteHeader(http.StatusCreated) }
	if n < len(rec.answers) {
		answer = rec.answers[n]
	}
	rec.mu.Unlock()
	answer(w)
}

func status(code int) func(http.ResponseWriter) {
	return func(w http.ResponseWriter) { w.WriteHeader(code) }
}

func drop(w http.ResponseWriter) {
	conn, _, err := w.(http.Hijacker).Hijack()
	if err == nil {
		conn.Close()
	}
}

func newClient(tr *client.Transport) *http.Client {
	tr.InitialBackoff = time.Millisecond
	tr.MaxBackoff = 5 * time.Millisecond
	return &http.Client{Transport: tr}
}

func TestRetriesWithSameKeyAndBody(t *testing.T) {
	rec := &recorder{answers: []func(http.ResponseWriter){drop, status(503), status(409), status(429), status(201)}}
	srv := httptest.NewServer(rec)
	defer srv.Close()
	c := newClient(&client.Transport{})
	resp, err := c.Post(srv.URL, "application/json", strings.NewReader(`{"a":1}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 201 {
		t.Fatalf("status = %d, want 201", resp.StatusCode)
	}
	if len(rec.keys) != 5 {
		t.Fatalf("attempts = %d, want 5", len(rec.keys))
	}
	uuid := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	for i := range rec.keys {
		if rec.keys[i] != rec.keys[0] || rec.bodies[i] != `{"a":1}` {
			t.Errorf("attempt %d: key %q body %q, want %q %q", i, rec.keys[i], rec.bodies[i], rec.keys[0], `{"a":1}`)
		}
	}
	if !uuid.MatchString(rec.keys[0]) {
		t.Errorf("key %q is not a UUIDv4", rec.keys[0])
	}
}

func TestKeyFromContextAndHeader(t *testing.T) {
	rec := &recorder{}
	srv := httptest.NewServer(rec)
	defer srv.Close()
	c := newClient(&client.Transport{})
	req, _ := http.NewRequestWithContext(client.WithKey(context.Background(), "ctx-key"), "POST", srv.URL, strings.NewReader("x"))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	req, _ = http.NewRequest("PATCH", srv.URL, strings.NewReader("x"))
	req.Header.Set("Idempotency-Key", "own-key")
	resp, err = c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	resp, err = c.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	want := []string{"ctx-key", "own-key", ""}
	for i := range want {
		if rec.keys[i] != want[i] {
			t.Errorf("request %d key = %q, want %q", i, rec.keys[i], want[i])
		}
	}
}

func TestFinalAnswersAreNotRetried(t *testing.T) {
	for _, code := range []int{200, 201, 400, 402, 404, 422} {
		rec := &recorder{answers: []func(http.ResponseWriter){status(code)}}
		srv := httptest.NewServer(rec)
		c := newClient(&client.Transport{})
		resp, err := c.Post(srv.URL, "text/plain", strings.NewReader("x"))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != code || len(rec.keys) != 1 {
			t.Errorf("%d: got %d after %d attempts, want one attempt", code, resp.StatusCode, len(rec.keys))
		}
		srv.Close()
	}
}

func TestRetryAfterHonoured(t *testing.T) {
	rec := &recorder{answers: []func(http.ResponseWriter){
		func(w http.ResponseWriter) { w.Header().Set("Retry-After", "1"); w.WriteHeader(409) },
	}}
	srv := httptest.NewServer(rec)
	defer srv.Close()
	var pauses []time.Duration
	c := newClient(&client.Transport{OnRetry: func(_ int, _ *http.Response, _ error, p time.Duration) { pauses = append(pauses, p) }})
	start := time.Now()
	resp, err := c.Post(srv.URL, "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 201 || time.Since(start) < time.Second || len(pauses) != 1 || pauses[0] != time.Second {
		t.Errorf("status %d after %v, pauses %v; want 201 after Retry-After (1s)", resp.StatusCode, time.Since(start), pauses)
	}
}

func TestAttemptTimeoutRetried(t *testing.T) {
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			// The first attempt hangs until its client gives up on it (the
			// server sees the connection close once the body is read).
			_, _ = io.Copy(io.Discard, r.Body)
			select {
			case <-r.Context().Done():
			case <-time.After(10 * time.Second): // a deadline, not a pause: AttemptTimeout is 100ms
				t.Error("the first attempt was never given up")
			}
		}
		w.WriteHeader(201)
		io.WriteString(w, "done")
	}))
	defer srv.Close()
	c := newClient(&client.Transport{AttemptTimeout: 100 * time.Millisecond})
	resp, err := c.Post(srv.URL, "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body) // readable after RoundTrip returned
	resp.Body.Close()
	if resp.StatusCode != 201 || string(b) != "done" || calls.Load() != 2 {
		t.Errorf("got %d %q after %d calls, want 201 done after 2", resp.StatusCode, b, calls.Load())
	}
}

func TestStopsAtDeadlineAndMaxAttempts(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(503) }))
	defer srv.Close()
	c := newClient(&client.Transport{MaxAttempts: 3})
	resp, err := c.Post(srv.URL, "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 {
		t.Errorf("after MaxAttempts: %d, want the last answer 503", resp.StatusCode)
	}

	c = &http.Client{Transport: &client.Transport{InitialBackoff: 50 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, MaxAttempts: 1000}}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL, strings.NewReader("x"))
	start := time.Now()
	resp, err = c.Do(req)
	if err == nil {
		resp.Body.Close()
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Errorf("returned after %v, want about the 300ms deadline", el)
	}
}

// TestLargeBodyReadAfterReturn: the exchange's deadline must not cut the
// body of the final answer while the caller reads it.
func TestLargeBodyReadAfterReturn(t *testing.T) {
	big := strings.Repeat("x", 8<<20)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
		io.WriteString(w, big)
	}))
	defer srv.Close()
	c := newClient(&client.Transport{})
	resp, err := c.Post(srv.URL, "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || len(b) != len(big) {
		t.Fatalf("read %d of %d bytes: %v", len(b), len(big), err)
	}
}

// timed serves answers in order and remembers when each attempt came.
type timed struct {
	mu      sync.Mutex
	at      []time.Time
	answers []func(w http.ResponseWriter)
}

func (s *timed) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	s.mu.Lock()
	n := len(s.at)
	s.at = append(s.at, time.Now())
	answer := func(w http.ResponseWriter) { w.WriteHeader(http.StatusCreated) }
	if n < len(s.answers) {
		answer = s.answers[n]
	}
	s.mu.Unlock()
	answer(w)
}

func (s *timed) attempts() []time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]time.Time(nil), s.at...)
}

func retryAfter(code int, v string) func(http.ResponseWriter) {
	return func(w http.ResponseWriter) { w.Header().Set("Retry-After", v); w.WriteHeader(code) }
}

// TestRetryAfterHugeDoesNotStorm: a Retry-After too large for a
// time.Duration (or for an int64) must not wrap into a negative pause and a
// retry storm; it is capped, and a pause past the deadline ends the exchange
// with the last answer.
func TestRetryAfterHugeDoesNotStorm(t *testing.T) {
	for _, v := range []string{"9999999999", "99999999999999999999", "9223372036854775807"} {
		t.Run(v, func(t *testing.T) {
			srv := &timed{}
			for range 10 {
				srv.answers = append(srv.answers, retryAfter(503, v))
			}
			hs := httptest.NewServer(srv)
			defer hs.Close()
			var pauses []time.Duration
			c := newClient(&client.Transport{OnRetry: func(_ int, _ *http.Response, _ error, p time.Duration) { pauses = append(pauses, p) }})
			const deadline = 500 * time.Millisecond
			ctx, cancel := context.WithTimeout(context.Background(), deadline)
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, "POST", hs.URL, strings.NewReader("x"))
			start := time.Now()
			resp, err := c.Do(req)
			el := time.Since(start)
			if err != nil {
				t.Fatalf("err %v, want the last answer (503)", err)
			}
			resp.Body.Close()
			if n := len(srv.attempts()); n > 2 {
				t.Errorf("%d attempts in %v (pauses %v), want at most 2", n, el, pauses)
			}
			if resp.StatusCode != 503 {
				t.Errorf("status %d, want the last answer 503", resp.StatusCode)
			}
			if el > deadline {
				t.Errorf("returned after %v, want within the %v deadline", el, deadline)
			}
			for _, p := range pauses {
				if p < 0 {
					t.Errorf("negative pause %v", p)
				}
			}
		})
	}
}

// TestRetryAfterHTTPDate: an HTTP-date ahead is a pause until then.
func TestRetryAfterHTTPDate(t *testing.T) {
	// HTTP-dates have whole seconds: two seconds ahead is 1–2s from now.
	when := time.Now().Add(2 * time.Second).UTC().Format(http.TimeFormat)
	srv := &timed{answers: []func(http.ResponseWriter){retryAfter(503, when)}}
	hs := httptest.NewServer(srv)
	defer hs.Close()
	c := newClient(&client.Transport{})
	resp, err := c.Post(hs.URL, "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	at := srv.attempts()
	if resp.StatusCode != 201 || len(at) != 2 {
		t.Fatalf("status %d after %d attempts, want 201 after 2", resp.StatusCode, len(at))
	}
	if gap := at[1].Sub(at[0]); gap < 900*time.Millisecond || gap > 4*time.Second {
		t.Errorf("retried %v after Retry-After: %s, want about 1–2s", gap, when)
	}
}

// TestRetryAfterPastHTTPDate: a date in the past means retry at once, not
// after the usual backoff (here a long one).
func TestRetryAfterPastHTTPDate(t *testing.T) {
	for _, when := range []string{
		time.Now().Add(-time.Hour).UTC().Format(http.TimeFormat),
		"Sunday, 06-Nov-94 08:49:37 GMT", // RFC 850
		"Sun Nov  6 08:49:37 1994",       // asctime
	} {
		t.Run(when, func(t *testing.T) {
			srv := &timed{answers: []func(http.ResponseWriter){retryAfter(429, when)}}
			hs := httptest.NewServer(srv)
			defer hs.Close()
			var pauses []time.Duration
			c := &http.Client{Transport: &client.Transport{
				InitialBackoff: 2 * time.Second, MaxBackoff: 2 * time.Second,
				OnRetry: func(_ int, _ *http.Response, _ error, p time.Duration) { pauses = append(pauses, p) },
			}}
			resp, err := c.Post(hs.URL, "text/plain", strings.NewReader("x"))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			at := srv.attempts()
			if resp.StatusCode != 201 || len(at) != 2 {
				t.Fatalf("status %d after %d attempts, want 201 after 2", resp.StatusCode, len(at))
			}
			if gap := at[1].Sub(at[0]); gap > 500*time.Millisecond || len(pauses) != 1 || pauses[0] != 0 {
				t.Errorf("retried after %v (pauses %v), want at once", gap, pauses)
			}
		})
	}
}

// TestRetryAfterMalformed: a value that is neither delay-seconds (digits
// only) nor an HTTP-date is ignored: the usual backoff applies.
func TestRetryAfterMalformed(t *testing.T) {
	for _, v := range []string{"soon", "1.5", "-1", "+1", "-0", "0x10", "1e3", "1 2", "Mon, 32 Foo 2099 99:99:99 GMT"} {
		t.Run(v, func(t *testing.T) {
			srv := &timed{answers: []func(http.ResponseWriter){retryAfter(503, v)}}
			hs := httptest.NewServer(srv)
			defer hs.Close()
			var pauses []time.Duration
			c := newClient(&client.Transport{OnRetry: func(_ int, _ *http.Response, _ error, p time.Duration) { pauses = append(pauses, p) }})
			resp, err := c.Post(hs.URL, "text/plain", strings.NewReader("x"))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			// newClient: InitialBackoff 1ms, so the first pause is in [0.5ms, 1ms].
			if resp.StatusCode != 201 || len(pauses) != 1 || pauses[0] < time.Millisecond/2 || pauses[0] > time.Millisecond {
				t.Errorf("status %d, pauses %v; want 201 after one pause of the usual backoff [0.5ms, 1ms]", resp.StatusCode, pauses)
			}
		})
	}
}

// TestRetryAfterCapped: a Retry-After beyond MaxRetryAfter, in seconds or as
// a date, waits MaxRetryAfter when the deadline leaves room for it.
func TestRetryAfterCapped(t *testing.T) {
	for _, v := range []string{"9999999999", "3600", "Fri, 31 Dec 9999 23:59:59 GMT"} {
		t.Run(v, func(t *testing.T) {
			srv := &timed{answers: []func(http.ResponseWriter){retryAfter(503, v)}}
			hs := httptest.NewServer(srv)
			defer hs.Close()
			var pauses []time.Duration
			c := newClient(&client.Transport{
				MaxRetryAfter: 100 * time.Millisecond,
				OnRetry:       func(_ int, _ *http.Response, _ error, p time.Duration) { pauses = append(pauses, p) },
			})
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, "POST", hs.URL, strings.NewReader("x"))
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			at := srv.attempts()
			if resp.StatusCode != 201 || len(at) != 2 || len(pauses) != 1 || pauses[0] != 100*time.Millisecond {
				t.Fatalf("status %d after %d attempts, pauses %v; want 201 after one pause of 100ms", resp.StatusCode, len(at), pauses)
			}
			if gap := at[1].Sub(at[0]); gap < 90*time.Millisecond || gap > 2*time.Second {
				t.Errorf("retried after %v, want about 100ms", gap)
			}
		})
	}
}

// TestRetryAfterZeroDoesNotStorm: a server that keeps answering
// "Retry-After: 0", or an HTTP-date already past by the client's clock (a
// server whose clock is a few seconds behind, asking for a pause of a few
// seconds), must not make every pause zero and draw the default client's 8
// attempts back to back (issue 9, point 3): Retry-After may shorten the
// first retry's pause, but from the second on the usual backoff is a floor.
func TestRetryAfterZeroDoesNotStorm(t *testing.T) {
	for name, value := range map[string]func() string{
		"zero":              func() string { return "0" },
		"skewed-clock-date": func() string { return time.Now().Add(-10*time.Second + 3*time.Second).UTC().Format(http.TimeFormat) },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel() // each takes the default backoff's ~10s
			var mu sync.Mutex
			var at []time.Time
			hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				at = append(at, time.Now())
				mu.Unlock()
				w.Header().Set("Retry-After", value())
				w.WriteHeader(http.StatusServiceUnavailable)
			}))
			defer hs.Close()
			c := &http.Client{Transport: &client.Transport{}} // defaults: 8 attempts, 100ms initial backoff
			start := time.Now()
			resp, err := c.Post(hs.URL, "application/json", strings.NewReader(`{}`))
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			el := time.Since(start)
			mu.Lock()
			n := len(at)
			mu.Unlock()
			// Without Retry-After the default backoff spaces 8 attempts over
			// >= 3 s; within 100 ms at most 2 attempts go out.
			if n > 3 && el < 100*time.Millisecond {
				t.Errorf("%d attempts in %v against a server answering 503 Retry-After: %s; want the backoff kept (no storm)", n, el, value())
			}
		})
	}
}
