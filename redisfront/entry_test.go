package redisfront

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

// TestCorruptEntryStatusRefused: a cache entry that decodes but holds a status
// no stored answer can have (the recorder never stores one under 200)
// comes from corruption or a foreign writer. It must be refused and the
// inner store must decide, never replayed: a status under 100 makes
// net/http's WriteHeader panic, a 1xx is sent as an informational answer.
func TestCorruptEntryStatusRefused(t *testing.T) {
	for _, status := range []int{0, 42, 99, 103, 199} {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			s, _, rdb := testStore(t, Options{})
			ctx := context.Background()
			p := params("adv2-status", "fp")
			complete(t, s, lease(t, s, p), "real")
			k := s.keysFor(p.User, p.Key)
			bad := encodeEntry(p.Fingerprint, time.Time{}, &idemdriver.Response{Status: status, Body: []byte("garbage")})
			if err := rdb.Set(ctx, k.resp, bad, time.Minute).Err(); err != nil {
				t.Fatal(err)
			}
			p.Owner = idemdriver.NewOwner()
			c, err := s.Claim(ctx, p)
			if err != nil || c.Response == nil {
				t.Fatalf("Claim = %+v, %v; want the inner store's replay", c, err)
			}
			if c.Response.Status != 201 || string(c.Response.Body) != "real" {
				t.Errorf("replayed status %d body %q from a corrupt entry; want 201 %q from the inner store",
					c.Response.Status, c.Response.Body, "real")
			}
		})
	}
}

// TestCorruptEntryThroughMiddleware: the same, end to end: the
// middleware must not panic on a corrupt entry, and must answer what the
// inner store holds.
func TestCorruptEntryThroughMiddleware(t *testing.T) {
	s, _, rdb := testStore(t, Options{})
	runs := 0
	h := idem.Middleware(s, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte("real"))
	}))
	send := func() (code int, body string, panicked any) {
		defer func() { panicked = recover() }()
		req := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader(`{"a":1}`))
		req.Header.Set("Idempotency-Key", "adv2-mw")
		req.Header.Set("Content-Type", "application/json")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		return w.Code, w.Body.String(), nil
	}
	if code, _, p := send(); code != 201 || p != nil {
		t.Fatalf("first: %d, panic %v", code, p)
	}
	k := s.keysFor("", "adv2-mw")
	raw, err := rdb.Get(context.Background(), k.resp).Result()
	if err != nil {
		t.Fatalf("no cache entry after the first request: %v", err)
	}
	e, err := decodeEntry(raw)
	if err != nil {
		t.Fatal(err)
	}
	bad := encodeEntry(e.fingerprint, time.Time{}, &idemdriver.Response{Status: 0, Body: []byte("garbage")})
	if err := rdb.Set(context.Background(), k.resp, bad, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	code, body, p := send()
	if p != nil || code != 201 || body != "real" || runs != 1 {
		t.Errorf("replay over a corrupt entry: %d %q, panic %v, %d runs; want 201 %q, no panic, 1 run", code, body, p, runs, "real")
	}
}

// TestTruncatedEntriesRefused: no proper prefix of an entry decodes, nor one
// with bytes appended: a truncated or padded value is never replayed.
func TestTruncatedEntriesRefused(t *testing.T) {
	resp := &idemdriver.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/o/1"}, "X-E": {}},
		Trailer: http.Header{"Digest": {"x"}}, Body: []byte(`{"id":1}`)}
	full := encodeEntry("fingerprint|with|bars", time.Unix(0, 12345), resp)
	if _, err := decodeEntry(full); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < len(full); i++ {
		if e, err := decodeEntry(full[:i]); err == nil {
			t.Errorf("prefix of %d/%d bytes decoded: %+v", i, len(full), e.resp)
		}
	}
	for _, tail := range []string{"\x00", "x", "\x03"} {
		if e, err := decodeEntry(full + tail); err == nil {
			t.Errorf("entry with %q appended decoded: %+v", tail, e.resp)
		}
	}
}

// TestClaimTokensUnique: claim tokens of two Stores in one process, taken
// from many goroutines, never repeat, and each Store's tokens carry a
// prefix of its own.
func TestClaimTokensUnique(t *testing.T) {
	a, b := New(nil, nil, Options{}), New(nil, nil, Options{})
	if a.tokenPrefix == b.tokenPrefix {
		t.Fatalf("two Stores share the token prefix %q", a.tokenPrefix)
	}
	var mu sync.Mutex
	seen := map[string]bool{}
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		s := []*Store{a, b}[g%2]
		wg.Add(1)
		go func() {
			defer wg.Done()
			local := make([]string, 0, 2000)
			for range 2000 {
				local = append(local, s.claimToken())
			}
			mu.Lock()
			defer mu.Unlock()
			for _, tok := range local {
				if seen[tok] {
					t.Errorf("token %q repeated", tok)
				}
				seen[tok] = true
				if l, ok := parseLock(tok); !ok || l.leased {
					t.Errorf("token %q does not parse as a claim in progress", tok)
				}
			}
		}()
	}
	wg.Wait()
}

// TestCachedReplayIsCallersOwn: two replays from the Redis cache share
// nothing a caller can change: mutating the first's header values, map
// and body leaves the second intact.
func TestCachedReplayIsCallersOwn(t *testing.T) {
	s, _, _ := testStore(t, Options{})
	p := params("adv2-own", "fp")
	l := lease(t, s, p)
	tx, err := s.Begin(context.Background(), l)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(context.Background(), &idemdriver.Response{Status: 201,
		Header: http.Header{"Content-Type": {"application/json"}, "Link": {"a", "b"}}, Body: []byte("body")}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 20 {
				q := p
				q.Owner = idemdriver.NewOwner()
				c, err := s.Claim(context.Background(), q)
				if err != nil || c.Response == nil {
					t.Errorf("Claim = %+v, %v", c, err)
					return
				}
				r := c.Response
				if r.Header.Get("Content-Type") != "application/json" || strings.Join(r.Header["Link"], ",") != "a,b" || string(r.Body) != "body" {
					t.Errorf("replay %+v", r)
				}
				for _, vs := range r.Header {
					for i := range vs {
						vs[i] = "MUTATED"
					}
				}
				r.Header["Link"] = append(r.Header["Link"], "c")
				r.Header.Set("X-New", "1")
				for i := range r.Body {
					r.Body[i] = 'X'
				}
			}
		}()
	}
	wg.Wait()
	if s.Metrics().ReplaysFromRedis.Load() == 0 {
		t.Error("no replay came from Redis")
	}
}
