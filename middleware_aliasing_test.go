package idem_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

// TestConcurrentRequestsShareNoValues runs many requests at once (duplicates of the
// same key, and keys whose kept request headers differ and change from one
// request to the next), with bodies around the exchange's room, and a
// client side that mutates, in place, every header value and body byte it
// got. Each key must run once; every answer must be its own request's;
// what the store keeps (request headers, the body while it runs, answer)
// must be exactly the request's, whatever the clients did to what they
// were handed.
func TestConcurrentRequestsShareNoValues(t *testing.T) {
	ms := memstore.New(memstore.Options{})
	var mu sync.Mutex
	runs := map[string]int{}
	keptBody := map[string][]byte{} // what the key kept of the body while it ran
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		key := r.Header.Get("Idempotency-Key")
		rec, err := ms.Get(r.Context(), "", key)
		mu.Lock()
		runs[key]++
		if err == nil {
			keptBody[key] = rec.Body
		}
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/o/"+key)
		w.WriteHeader(http.StatusCreated)
		// The handler mutates the header after WriteHeader, and reuses
		// its own buffer after Write.
		buf := append([]byte("echo:"), b...)
		w.Write(buf)
		for i := range buf {
			buf[i] = 'Z'
		}
		w.Header().Set("Location", "/o/"+key) // same value, new slice
	})
	mw := idem.Middleware(ms, idem.Options{User: idem.SharedKeySpace, KeptRequestHeaders: []string{"Content-Type", "X-Tenant"}})(h)

	const keys, dups = 24, 6
	type answer struct {
		status int
		loc    string
		ct     string
		body   string
	}
	answers := make([][]answer, keys)
	for i := range answers {
		answers[i] = make([]answer, dups)
	}
	bodyOf := func(i int) string {
		n := []int{0, 3, 480, 511, 512, 513, 900}[i%7]
		return fmt.Sprintf(`{"k":%d,"pad":"%s"}`, i, strings.Repeat(string(rune('a'+i%26)), n))
	}
	var wg sync.WaitGroup
	for round := 0; round < 2; round++ {
		for d := 0; d < dups; d++ {
			for i := 0; i < keys; i++ {
				wg.Add(1)
				go func(i, d int) {
					defer wg.Done()
					req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(bodyOf(i)))
					req.Header.Set("Idempotency-Key", fmt.Sprintf("adv2-%d", i))
					// Alternate a few kept-header sets, so the "last kept"
					// cache flips between them under concurrency.
					req.Header.Set("Content-Type", []string{"application/json", "application/json; charset=utf-8"}[i%2])
					req.Header.Set("X-Tenant", fmt.Sprintf("t%d", i%3))
					w := httptest.NewRecorder()
					mw.ServeHTTP(w, req)
					res := w.Result()
					rb, _ := io.ReadAll(res.Body)
					a := answer{res.StatusCode, res.Header.Get("Location"), res.Header.Get("Content-Type"), string(rb)}
					// The client mutates what it was handed, in place, and
					// the request's header after the fact.
					for _, vs := range w.Header() {
						for j := range vs {
							vs[j] = "MUTATED"
						}
					}
					b := w.Body.Bytes()
					for j := range b {
						b[j] = 'X'
					}
					req.Header["X-Tenant"][0] = "MUTATED"
					req.Header["Content-Type"][0] = "MUTATED"
					if a.status == http.StatusConflict {
						return // in flight: a retry will get the answer
					}
					answers[i][d] = a
				}(i, d)
			}
		}
		wg.Wait()
	}
	for i := 0; i < keys; i++ {
		key := fmt.Sprintf("adv2-%d", i)
		want := answer{http.StatusCreated, "/o/" + key, "application/json", "echo:" + bodyOf(i)}
		for d, a := range answers[i] {
			if a.status == 0 {
				continue
			}
			if a != want {
				t.Errorf("key %d dup %d: got %+v\nwant %+v", i, d, a, want)
			}
		}
		if runs[key] != 1 {
			t.Errorf("key %d ran %d times", i, runs[key])
		}
		rec, err := ms.Get(context.Background(), "", key)
		if err != nil {
			t.Fatalf("Get %s: %v", key, err)
		}
		wantCT := []string{"application/json", "application/json; charset=utf-8"}[i%2]
		if got := rec.Header.Get("Content-Type"); got != wantCT {
			t.Errorf("key %d kept Content-Type %q, want %q", i, got, wantCT)
		}
		if got := rec.Header.Get("X-Tenant"); got != fmt.Sprintf("t%d", i%3) {
			t.Errorf("key %d kept X-Tenant %q", i, got)
		}
		if len(rec.Header) != 2 {
			t.Errorf("key %d kept headers %v", i, rec.Header)
		}
		if !bytes.Equal(keptBody[key], []byte(bodyOf(i))) {
			t.Errorf("key %d kept body %q while it ran", i, keptBody[key])
		}
		if len(rec.Body) != 0 {
			t.Errorf("key %d kept its body %q once completed", i, rec.Body)
		}
		if rec.Response == nil || string(rec.Response.Body) != want.body ||
			rec.Response.Header.Get("Location") != want.loc || rec.Response.Header.Get("Content-Type") != want.ct {
			t.Errorf("key %d stored %+v", i, rec.Response)
		}
	}
}
