package pitfalls

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/idem-go/idem/client"
)

// Trap (b): X-Request-ID (or a trace id) used as the idempotency key. It
// names one HTTP exchange, not one operation: the proxy that makes it
// makes a new one for every request it sees, so the client's retry of the
// same checkout arrives with a new one.

// TestRequestIDIsNotAKey: behind a proxy that stamps every request
// with a fresh X-Request-ID and starts a trace (traceparent) for every
// request that comes without one, a checkout whose answer was lost and
// that the client retries makes two orders and two charges when the
// service keys on X-Request-ID or on the trace id, and one order and one
// charge when it keys on the client's Idempotency-Key, which the proxy
// passes on untouched.
func TestRequestIDIsNotAKey(t *testing.T) {
	for _, tc := range []struct {
		name            string
		keyFrom         func(r *http.Request) string // nil: the client's Idempotency-Key
		orders, charges int
	}{
		{"naive/X-Request-ID as the key", func(r *http.Request) string { return r.Header.Get("X-Request-Id") }, 2, 2},
		{"naive/trace id as the key", traceID, 2, 2},
		{"the client's Idempotency-Key", nil, 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var (
				mu        sync.Mutex
				requestID []string // X-Request-ID of every request the service got
				keys      = map[string]bool{}
			)
			s := newService(t, serviceConfig{wrap: func(next http.Handler) http.Handler {
				return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					id := r.Header.Get("X-Request-Id")
					if tc.keyFrom != nil {
						r.Header.Set("Idempotency-Key", tc.keyFrom(r))
					}
					mu.Lock()
					requestID = append(requestID, id)
					keys[r.Header.Get("Idempotency-Key")] = true
					mu.Unlock()
					next.ServeHTTP(w, r)
				})
			}})
			target, err := url.Parse(s.srv.URL)
			if err != nil {
				t.Fatal(err)
			}
			// The edge proxy: a new X-Request-ID for every request (as
			// nginx's $request_id), and a new trace for every request
			// that does not continue one (W3C traceparent).
			proxy := httptest.NewServer(&httputil.ReverseProxy{Rewrite: func(pr *httputil.ProxyRequest) {
				pr.SetURL(target)
				pr.Out.Header.Set("X-Request-Id", client.NewKey())
				if pr.In.Header.Get("Traceparent") == "" {
					pr.Out.Header.Set("Traceparent", "00-"+randomHex(16)+"-"+randomHex(8)+"-01")
				}
			}})
			t.Cleanup(proxy.Close)

			lose := newLoseAnswers(proxy.Client().Transport, 1)
			hc := &http.Client{Transport: &client.Transport{Base: lose}}
			a := send(hc, s.request(t, context.Background(), proxy.URL, "alice"))
			if a.status != http.StatusCreated || lose.lost.Load() != 1 {
				t.Fatalf("checkout: %d %v %s (%d answers lost); want a 201 after one lost answer", a.status, a.err, a.body, lose.lost.Load())
			}
			mu.Lock()
			if len(requestID) != 2 || requestID[0] == requestID[1] || requestID[0] == "" {
				t.Errorf("X-Request-ID of the attempts: %q; want two, distinct", requestID)
			}
			if want := map[bool]int{true: 2, false: 1}[tc.keyFrom != nil]; len(keys) != want {
				t.Errorf("%d idempotency keys seen, want %d", len(keys), want)
			}
			mu.Unlock()
			wantCounts(t, s, "alice", tc.orders, tc.charges)
		})
	}
}

// traceID is the trace-id field of r's W3C traceparent header.
func traceID(r *http.Request) string {
	parts := strings.Split(r.Header.Get("Traceparent"), "-")
	if len(parts) != 4 {
		return ""
	}
	return parts[1]
}
