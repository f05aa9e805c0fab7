package idem_test

// The query string is part of what a request means (POST
// /transfers?dry_run=true is not POST /transfers), so it is part of the
// default fingerprint, in a canonical form: parameters sorted by name,
// percent-encoding decoded, empty segments dropped.

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/problem"
)

// transfers serves a handler that answers 201 behind the middleware on
// memstore, and counts its runs.
func transfers(t *testing.T, opts idem.Options) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var runs atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"dry_run":`+boolJSON(r.URL.Query().Get("dry_run") == "true")+`}`)
	})
	srv := httptest.NewServer(idem.Middleware(memstore.New(memstore.Options{}), opts)(h))
	t.Cleanup(srv.Close)
	return srv, &runs
}

func boolJSON(b bool) string {
	if b {
		return "true"
	}
	return "false"
}

func postTransfer(t *testing.T, srv *httptest.Server, target, key string) result {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, srv.URL+target, strings.NewReader(`{"amount":100,"to":"acct_1"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return result{resp.StatusCode, resp.Header, string(b)}
}

// A dry run and the real transfer under one key are two requests: the
// second is refused (422) instead of being answered with the dry run's
// result while no transfer is made.
func TestMiddlewareQueryChangesTheRequest(t *testing.T) {
	srv, runs := transfers(t, idem.Options{User: idem.SharedKeySpace})
	if r := postTransfer(t, srv, "/transfers?dry_run=true", "k"); r.status != http.StatusCreated {
		t.Fatalf("dry run: %d %s", r.status, r.body)
	}
	r := postTransfer(t, srv, "/transfers", "k")
	if r.header.Get("Idempotent-Replayed") == "true" {
		t.Errorf("POST /transfers replayed the dry run's answer %d %s; want 422", r.status, r.body)
	}
	wantProblem(t, r, http.StatusUnprocessableEntity, problem.KeyMismatch)
	if got := runs.Load(); got != 1 {
		t.Errorf("handler runs = %d, want 1 (the dry run only)", got)
	}
	// The same query, spelt another way, is the same request: replayed.
	r = postTransfer(t, srv, "/transfers?%64ry_run=true&", "k")
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("the dry run again: %d, Idempotent-Replayed %q; want its 201 replayed", r.status, r.header.Get("Idempotent-Replayed"))
	}
	if got := runs.Load(); got != 1 {
		t.Errorf("handler runs = %d, want 1", got)
	}
}

func TestFingerprintQuery(t *testing.T) {
	fp := func(target string) string {
		t.Helper()
		s, err := idem.Fingerprint(httptest.NewRequest(http.MethodPost, target, nil), []byte(`{"a":1}`))
		if err != nil {
			t.Fatalf("Fingerprint(%s): %v", target, err)
		}
		return s
	}
	same := []struct{ why, a, b string }{
		{"names sorted", "/x?b=2&a=1", "/x?a=1&b=2"},
		{"repeated names keep their order among the others", "/x?b=1&a=2&a=1", "/x?a=2&b=1&a=1"},
		{"percent-encoding decoded", "/x?%61=1", "/x?a=1"},
		{"in values too", "/x?a=%31%32", "/x?a=12"},
		{"hex digits in either case", "/x?a=%2f", "/x?a=%2F"},
		{"unreserved characters", "/x?a=%7E%2D", "/x?a=~-"},
		{"+ is a space", "/x?a=b+c", "/x?a=b%20c"},
		{"empty segments", "/x?a=1&&b=2&", "/x?a=1&b=2"},
		{"a leading empty segment", "/x?&a=1", "/x?a=1"},
		{"no parameter", "/x?&&&", "/x"},
		{"non-ASCII", "/x?n=caf%C3%A9", "/x?n=café"},
	}
	for _, c := range same {
		if fp(c.a) != fp(c.b) {
			t.Errorf("%s: %s and %s have different fingerprints, want one", c.why, c.a, c.b)
		}
	}
	differ := []struct{ why, a, b string }{
		{"a query and none", "/transfers?dry_run=true", "/transfers"},
		{"another value", "/x?a=1", "/x?a=2"},
		{"another name", "/x?a=1", "/x?b=1"},
		{"the values of one name reordered", "/x?a=1&a=2", "/x?a=2&a=1"},
		{"a value repeated", "/x?a=1", "/x?a=1&a=1"},
		{"an escaped & is data", "/x?a=b&c", "/x?a=b%26c"},
		{"an escaped = is data", "/x?a=b=c", "/x?a%3Db=c"},
		{"an escaped + is a plus", "/x?a=b%2Bc", "/x?a=b+c"},
		{"a name without = and one with an empty value", "/x?a", "/x?a="},
		{"a segment that does not decode is kept as it came", "/x?a=%zz", "/x?a=%25zz"},
		{"a literal ; is not an escaped one", "/x?a=1;b=2", "/x?a=1%3Bb=2"},
		{"name and value lengths", "/x?ab=c", "/x?a=bc"},
		{"the query is not the path", "/x?a=1", "/x%3Fa=1"},
		{"a parameter without a value", "/x?a", "/x"},
	}
	for _, c := range differ {
		if fp(c.a) == fp(c.b) {
			t.Errorf("%s: %s and %s have one fingerprint, want two", c.why, c.a, c.b)
		}
	}
}

// FingerprintWithoutQuery is the fingerprint of releases before the query
// was hashed: the same as Fingerprint's without a query, whatever the
// query, and it still refuses a body that repeats a member name.
func TestFingerprintWithoutQuery(t *testing.T) {
	const body = `{"items":[{"sku":"SKU-1","quantity":2,"unit_price":1299}],"currency":"EUR"}`
	const released = "4b05e6112be14eef91f1765baf7d86bc96ff8a72ea439a50fb3e2df10545113d" // fingerprint_pinned_test.go
	for _, target := range []string{"/v1/orders", "/v1/orders?", "/v1/orders?utm_source=x", "/v1/orders?dry_run=true&a=%zz"} {
		got, err := idem.FingerprintWithoutQuery(httptest.NewRequest(http.MethodPost, target, nil), []byte(body))
		if err != nil {
			t.Fatalf("FingerprintWithoutQuery(%s): %v", target, err)
		}
		if got != released {
			t.Errorf("FingerprintWithoutQuery(%s) = %s, want %s", target, got, released)
		}
	}
	_, err := idem.FingerprintWithoutQuery(httptest.NewRequest(http.MethodPost, "/v1/orders?a=1", nil), []byte(`{"a":1,"A":2}`))
	if !errors.Is(err, idem.ErrBadBody) {
		t.Errorf("FingerprintWithoutQuery of a repeated member name: %v, want ErrBadBody", err)
	}
}

// With Options.Fingerprint = FingerprintWithoutQuery the query is not part
// of the request: a retry that gained a tracking parameter is replayed.
func TestMiddlewareFingerprintWithoutQuery(t *testing.T) {
	srv, runs := transfers(t, idem.Options{User: idem.SharedKeySpace, Fingerprint: idem.FingerprintWithoutQuery})
	if r := postTransfer(t, srv, "/transfers", "k"); r.status != http.StatusCreated {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	r := postTransfer(t, srv, "/transfers?utm_source=retry", "k")
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("retry with a query: %d, Idempotent-Replayed %q; want the first answer replayed", r.status, r.header.Get("Idempotent-Replayed"))
	}
	if got := runs.Load(); got != 1 {
		t.Errorf("handler runs = %d, want 1", got)
	}
}

// Hashing the query allocates nothing of its own once the pooled
// buffers have grown: a request with a query allocates what one without
// does (the returned string).
func TestFingerprintQueryAllocations(t *testing.T) {
	if testing.Short() {
		t.Skip("counts allocations")
	}
	body := []byte(`{"sku":"sku_42","quantity":1,"currency":"EUR"}`)
	count := func(target string) float64 {
		r := httptest.NewRequest(http.MethodPost, target, nil)
		fewest := -1.0
		for range 50 { // a sync.Pool the race detector empties at random adds to some calls
			n := testing.AllocsPerRun(1, func() {
				if _, err := idem.Fingerprint(r, body); err != nil {
					t.Fatal(err)
				}
			})
			if fewest < 0 || n < fewest {
				fewest = n
			}
		}
		return fewest
	}
	without := count("/v1/orders")
	with := count("/v1/orders?expand=customer&dry_run=true&note=a+b%2Fc&expand=items&z&%zz")
	if with > without {
		t.Errorf("Fingerprint allocates %v times with a query, %v without; want no more", with, without)
	}
	if without > 1 {
		t.Errorf("Fingerprint allocates %v times without a query, want at most 1 (its result)", without)
	}
}
