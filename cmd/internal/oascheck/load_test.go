package oascheck

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
)

func TestLoadDescription(t *testing.T) {
	doc, err := Load(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if doc.OpenAPI != "3.1.0" || !doc.IsOpenAPI31OrLater() {
		t.Fatalf("openapi = %q", doc.OpenAPI)
	}
	c, err := New(Addrs{Orders: []string{"http://127.0.0.1:1"}, Gateway: []string{"http://127.0.0.1:2"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := len(c.Operations(false)); got != 9 {
		t.Errorf("order service operations: %d %v", got, c.Operations(false))
	}
	if got := len(c.Operations(true)); got != 6 {
		t.Errorf("gateway operations: %d %v", got, c.Operations(true))
	}
}

// TestCheckerCatches shows that the Checker reports each kind of
// mismatch, against a fake order service that answers what the test
// tells it to (header X-Answer).
func TestCheckerCatches(t *testing.T) {
	const problemJSON = "application/problem+json"
	problem := func(typ string, status int) string {
		return `{"type":"https://idem-go.github.io/problems/` + typ + `","title":"t","status":` + strconv.Itoa(status) + `,"detail":"d"}`
	}
	answers := map[string]func(w http.ResponseWriter){
		"health ok": func(w http.ResponseWriter) { writeBody(w, 200, "application/json", `{"status":"ok"}`) },
		"health bad body": func(w http.ResponseWriter) {
			writeBody(w, 200, "application/json", `{"status":"fine"}`)
		},
		"teapot": func(w http.ResponseWriter) { writeBody(w, 418, problemJSON, problem("not-found", 418)) },
		"not found": func(w http.ResponseWriter) {
			writeBody(w, 404, problemJSON, problem("not-found", 404))
		},
		"not found, other type": func(w http.ResponseWriter) {
			writeBody(w, 404, problemJSON, problem("unauthorized", 404))
		},
		"not found, undocumented header": func(w http.ResponseWriter) {
			w.Header().Set("X-Debug", "1")
			writeBody(w, 404, problemJSON, problem("not-found", 404))
		},
		"not found, as JSON": func(w http.ResponseWriter) {
			writeBody(w, 404, "application/json", problem("not-found", 404))
		},
		"unauthorized without challenge": func(w http.ResponseWriter) {
			writeBody(w, 401, problemJSON, problem("unauthorized", 401))
		},
		"unauthorized": func(w http.ResponseWriter) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="orders"`)
			writeBody(w, 401, problemJSON, problem("unauthorized", 401))
		},
		"in flight without detail": func(w http.ResponseWriter) {
			w.Header().Set("Retry-After", "1")
			writeBody(w, 409, problemJSON, `{"type":"https://idem-go.github.io/problems/idempotency-key-in-flight","title":"t","status":409}`)
		},
		"created without location": func(w http.ResponseWriter) {
			writeBody(w, 201, "application/json", `{"id":"ord_000000000000000000000000","user_id":"u","status":"paid","items":[{"sku":"a","quantity":1,"unit_price":1}],"total":1,"currency":"EUR","payment_id":"pi_1","created_at":"2026-12-01T00:00:00Z"}`)
		},
		"created, replayed: yes": func(w http.ResponseWriter) {
			w.Header().Set("Location", "/v1/orders/ord_000000000000000000000000")
			w.Header().Set("Idempotent-Replayed", "yes")
			writeBody(w, 201, "application/json", `{"id":"ord_000000000000000000000000","user_id":"u","status":"paid","items":[{"sku":"a","quantity":1,"unit_price":1}],"total":1,"currency":"EUR","payment_id":"pi_1","created_at":"2026-12-01T00:00:00Z"}`)
		},
		"in flight, retry later": func(w http.ResponseWriter) {
			w.Header().Set("Retry-After", "later")
			writeBody(w, 409, problemJSON, problem("idempotency-key-in-flight", 409))
		},
		"405": func(w http.ResponseWriter) {
			w.Header().Set("Allow", "GET, HEAD")
			writeBody(w, 405, problemJSON, problem("method-not-allowed", 405))
		},
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		answers[r.Header.Get("X-Answer")](w)
	}))
	defer srv.Close()
	const body = `{"items":[{"sku":"SKU-1","quantity":2,"unit_price":1299}],"currency":"EUR"}`
	for _, tc := range []struct {
		name, method, path, answer, body string
		auth, key                        bool
		invalid                          bool
		want                             string // in the one error; "" for none
	}{
		{"valid", "GET", "/healthz", "health ok", "", false, false, false, ""},
		{"response body", "GET", "/healthz", "health bad body", "", false, false, false, "response body doesn't match"},
		{"undocumented status", "GET", "/v1/orders/ord_1", "teapot", "", true, false, false, "status is not supported"},
		{"problem type", "GET", "/v1/orders/ord_1", "not found, other type", "", true, false, false, "response body doesn't match"},
		{"undocumented header", "GET", "/v1/orders/ord_1", "not found, undocumented header", "", true, false, false, "X-Debug"},
		{"content type", "GET", "/v1/orders/ord_1", "not found, as JSON", "", true, false, false, "Content-Type"},
		{"required header", "GET", "/v1/orders/ord_1", "unauthorized without challenge", "", true, false, false, "WWW-Authenticate"},
		{"problem detail", "POST", "/v1/orders", "in flight without detail", body, true, true, false, "detail"},
		{"Location", "POST", "/v1/orders", "created without location", body, true, true, false, "Location"},
		{"header const", "POST", "/v1/orders", "created, replayed: yes", body, true, true, false, "Idempotent-Replayed"},
		{"header type", "POST", "/v1/orders", "in flight, retry later", body, true, true, false, "Retry-After"},
		{"missing credential", "GET", "/v1/orders/ord_1", "unauthorized", "", false, false, false, "security requirement"},
		{"missing credential, expected", "GET", "/v1/orders/ord_1", "unauthorized", "", false, false, true, ""},
		{"invalid body", "POST", "/v1/orders", "unauthorized", `{"items":[],"currency":"EUR"}`, true, true, false, "request does not match"},
		{"invalid body, expected", "POST", "/v1/orders", "unauthorized", `{"items":[],"currency":"eur"}`, true, true, true, ""},
		{"valid body said invalid", "POST", "/v1/orders", "unauthorized", body, true, true, true, "expected to be outside"},
		{"missing key", "POST", "/v1/orders", "unauthorized", body, true, false, false, "Idempotency-Key"},
		{"no route", "GET", "/nope", "not found", "", false, false, false, "no operation"},
		{"no route, expected", "GET", "/nope", "not found", "", false, false, true, ""},
		{"no method, expected", "DELETE", "/v1/orders", "405", "", false, false, true, ""},
		{"no route, wrong answer", "GET", "/nope", "teapot", "", false, false, true, "status is not supported"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := New(Addrs{Orders: []string{srv.URL}})
			if err != nil {
				t.Fatal(err)
			}
			req, _ := http.NewRequest(tc.method, srv.URL+tc.path, strings.NewReader(tc.body))
			req.Header.Set("X-Answer", tc.answer)
			if tc.body != "" {
				req.Header.Set("Content-Type", "application/json")
			}
			if tc.auth {
				req.Header.Set("Authorization", "Bearer x.y.z")
			}
			if tc.key {
				req.Header.Set("Idempotency-Key", "k")
			}
			if tc.invalid {
				req = ExpectInvalid(req)
			}
			resp, err := c.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			errs := c.Errors()
			switch {
			case tc.want == "" && len(errs) > 0:
				t.Errorf("errors %q, want none", errs)
			case tc.want != "" && (len(errs) != 1 || !strings.Contains(errs[0], tc.want)):
				t.Errorf("errors %q, want one about %q", errs, tc.want)
			}
		})
	}
}

func writeBody(w http.ResponseWriter, status int, ctype, body string) {
	w.Header().Set("Content-Type", ctype)
	w.WriteHeader(status)
	w.Write([]byte(body))
}
