package idem_test

// Escaped dot segments are kept apart from literal ones in the fingerprint,
// as a router keeps them apart (tests from the adversarial review of issue
// 9 (b); its third test, trailers counted in what MaxStoredBody bounds, is
// TestMaxStoredBodyBoundsTrailers in replay_headers_test.go).

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

// routing is what net/http.ServeMux does with a request: the pattern it
// picks, the status it answers without a handler (a redirect) and the
// path value the handler would see.
type routing struct {
	pattern  string
	status   int
	location string
	name     string
}

func dotSegmentMux(runs *int) *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /items/{name}", func(w http.ResponseWriter, r *http.Request) {
		*runs++
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "made item "+r.PathValue("name"))
	})
	mux.HandleFunc("POST /", func(w http.ResponseWriter, r *http.Request) {
		*runs++
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "made root")
	})
	return mux
}

func routeOf(mux *http.ServeMux, target string) routing {
	r := httptest.NewRequest(http.MethodPost, target, strings.NewReader(`{}`))
	_, pattern := mux.Handler(r)
	w := httptest.NewRecorder()
	mux.ServeHTTP(w, r)
	return routing{pattern: pattern, status: w.Code, location: w.Header().Get("Location"), name: w.Body.String()}
}

// TestDotSegmentsRoutedApartFingerprintedApart checks that a literal dot
// segment (/items/..) and an escaped one (/items/%2E%2E), which
// net/http.ServeMux routes apart, get different fingerprints.
//
// It guards a bug found in the review of issue 9 (b), as it was found:
// The fingerprint is meant to be the path "as a router sees it" (issue 9,
// point 4). net/http.ServeMux cleans literal dot segments (it redirects
// /items/.. to /) but routes an escaped one (/items/%2E%2E) to
// /items/{name} with name "..". routedPath decodes %2E%2E to ".." and so
// gives both the same fingerprint: the two requests, which the router
// sends to different places, share one key's answer.
func TestDotSegmentsRoutedApartFingerprintedApart(t *testing.T) {
	var runs int
	mux := dotSegmentMux(&runs)
	for _, pair := range [][2]string{
		{"/items/..", "/items/%2E%2E"},
		{"/items/.", "/items/%2e"},
		{"/items/x/../y", "/items/x%2F..%2Fy"}, // control: must differ, and does
	} {
		a, b := routeOf(mux, pair[0]), routeOf(mux, pair[1])
		if a == b {
			continue // the router does not tell them apart
		}
		fa, err := idem.Fingerprint(httptest.NewRequest(http.MethodPost, pair[0], nil), []byte(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		fb, err := idem.Fingerprint(httptest.NewRequest(http.MethodPost, pair[1], nil), []byte(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		if fa == fb {
			t.Errorf("%s (ServeMux: %+v) and %s (ServeMux: %+v) are routed apart but share one fingerprint",
				pair[0], a, pair[1], b)
		}
	}
}

// TestEscapedDotSegmentNeverReplaysOtherRoute checks end to end that a
// request to /items/%2E%2E never replays the stored answer of /items/..
// under the same key.
//
// It guards a bug found in the review of issue 9 (b), as it was found:
// End to end, with the middleware in front of a ServeMux: a POST to
// /items/.. is redirected (307, a 3xx, stored), and the same key on
// /items/%2E%2E, which the mux would route to the items handler, is
// answered with that stored redirect instead of 422 (or running).
func TestEscapedDotSegmentNeverReplaysOtherRoute(t *testing.T) {
	var runs int
	mux := dotSegmentMux(&runs)
	srv := httptest.NewServer(idem.Middleware(memstore.New(memstore.Options{}), idem.Options{User: idem.SharedKeySpace})(mux))
	defer srv.Close()
	do := func(path string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "k")
		c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	first := do("/items/..")
	if first.StatusCode != http.StatusTemporaryRedirect {
		t.Fatalf("first: %d, want ServeMux's 307", first.StatusCode)
	}
	second := do("/items/%2E%2E")
	if second.Header.Get("Idempotent-Replayed") == "true" {
		t.Errorf("POST /items/%%2E%%2E (ServeMux: /items/{name}, name \"..\") with the key of POST /items/.. "+
			"(ServeMux: 307 to /) replayed %d Location %q; want 422 (another route) or its own run",
			second.StatusCode, second.Header.Get("Location"))
	}
}
