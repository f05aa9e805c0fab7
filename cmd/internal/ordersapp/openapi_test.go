package ordersapp

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/cmd/internal/api"
	"github.com/idem-go/idem/cmd/internal/checkout"
	"github.com/idem-go/idem/cmd/internal/oascheck"
	"github.com/idem-go/idem/cmd/internal/paymentsapp"
	"github.com/idem-go/idem/internal/pgtest"
)

// TestOrderServiceMatchesOpenAPI drives a real order service (newServer, as `orders
// serve` builds it, on a loopback port) through every route of the order
// API and checks every request and response against cmd/internal/api/openapi.yaml:
// with the in-process gateway on SQLite and on PostgreSQL, and paying
// through a real `payments serve` (behind a proxy that checks the order
// service's own calls to the gateway against the description too).
func TestOrderServiceMatchesOpenAPI(t *testing.T) {
	skipInShort(t, "drives every operation of the API on every backend")
	t.Parallel()
	t.Run("sqlite", func(t *testing.T) {
		oasInProcessGateway(t, Config{DataDir: t.TempDir()})
	})
	t.Run("postgres", func(t *testing.T) {
		oasInProcessGateway(t, Config{DataDir: t.TempDir(), DatabaseURL: pgtest.Database(t)})
	})
	t.Run("payments-serve", oasPaymentsServe)
}

// oasConfig sets what every scenario's service needs on c.
func oasConfig(c *Config) {
	c.JWTSecret, c.KeyTTL, c.KeyLease, c.RequireKey = testSecret, 24*time.Hour, 30*time.Second, true
	c.GuestCheckout = true // the scenario signs in a guest
	if c.PaymentsKey == "" {
		c.PaymentsKey = "sk_test_local"
	}
}

func oasInProcessGateway(t *testing.T, c Config) {
	oasConfig(&c)
	// Each charge takes a second, so that a repeat finds the first in flight.
	c.gatewayLatency = time.Second
	svc := startInProcess(t, &c)
	ck, err := oascheck.New(oascheck.Addrs{Orders: []string{svc.base}})
	if err != nil {
		t.Fatal(err)
	}
	oasScenario(t, ck, svc.base, false)
	if c.DatabaseURL != "" {
		oasDatabaseGone(t, ck, svc.base, c.DatabaseURL)
	}
	ck.Report(t)
	ck.RequireAllOperations(t, false)
	t.Logf("exchanges checked: %v", ck.Seen())
}

func oasPaymentsServe(t *testing.T) {
	const key = "sk_test_oas"
	gw := oasStartPayments(t, "--api-key", key, "--latency", "1s", "--decline-over", "1000000")
	gwURL, _ := url.Parse(gw)
	// The order service pays through a proxy that checks its exchanges
	// with the gateway; the test checks its own with the order service.
	ck, err := oascheck.New(oascheck.Addrs{Gateway: []string{gw}})
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(gwURL)
	proxy.Transport = ck.Transport(nil)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ps := &http.Server{Handler: proxy}
	go ps.Serve(ln)
	t.Cleanup(func() { ps.Close() })

	c := Config{DataDir: t.TempDir(), PaymentsURL: "http://" + ln.Addr().String(), PaymentsKey: key}
	oasConfig(&c)
	svc := startInProcess(t, &c)
	// An instance whose gateway does not answer: 502.
	down := Config{DataDir: t.TempDir(), PaymentsURL: "http://" + oasClosedAddr(t), PaymentsKey: key}
	oasConfig(&down)
	svcDown := startInProcess(t, &down)

	ck2, err := oascheck.New(oascheck.Addrs{Orders: []string{svc.base, svcDown.base}})
	if err != nil {
		t.Fatal(err)
	}
	oasScenario(t, ck2, svc.base, true)

	hc := ck2.Client()
	a := oasDo(t, hc, svcDown.base, oasCall{method: "POST", path: "/v1/orders", token: token(t, "oas-down"), key: "oas-down-1", body: orderBody(1)})
	oasWant(t, "gateway down", a, http.StatusBadGateway)
	if a.obj["type"] != "https://idem-go.github.io/problems/payment-gateway-error" {
		t.Errorf("gateway down: %s", a.body)
	}

	svc.stop() // the completer and cleaner make no more gateway calls
	ck2.Report(t)
	ck2.RequireAllOperations(t, false)
	ck2.RequireSeen(t, "POST /v1/orders 402", "POST /v1/orders 502")
	ck.Report(t)
	ck.RequireSeen(t, "POST /v1/payment_intents 200", "POST /v1/payment_intents 402")
	t.Logf("exchanges checked with the order service: %v", ck2.Seen())
	t.Logf("exchanges of the order service with the gateway: %v", ck.Seen())
}

// oasDatabaseGone drops the service's database under it: health, reads
// and creates are answered 503 with Retry-After.
func oasDatabaseGone(t *testing.T, ck *oascheck.Checker, base, dbURL string) {
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, pgtest.URL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP DATABASE "+pgx.Identifier{strings.TrimPrefix(u.Path, "/")}.Sanitize()+" WITH (FORCE)"); err != nil {
		t.Fatal(err)
	}
	hc := ck.Client()
	hc.Timeout = 30 * time.Second
	tok := token(t, "oas-user")
	for _, c := range []oasCall{
		{method: "GET", path: "/healthz"},
		{method: "GET", path: "/v1/orders", token: tok},
		{method: "GET", path: "/v1/orders/ord_000000000000000000000000", token: tok},
		{method: "POST", path: "/v1/orders", token: tok, key: "oas-gone", body: orderBody(4)},
	} {
		a := oasDo(t, hc, base, c)
		oasWant(t, c.method+" "+c.path+" without a database", a, http.StatusServiceUnavailable)
		if a.header.Get("Retry-After") == "" {
			t.Errorf("%s %s without a database: no Retry-After: %v %s", c.method, c.path, a.header, a.body)
		}
	}
}

// oasStartPayments runs `payments serve` in process on a free loopback
// port and returns its base URL; it stops when t ends.
func oasStartPayments(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	logs := new(syncBuffer)
	done := make(chan int, 1)
	go func() {
		done <- (&paymentsapp.App{Args: append([]string{"serve", "--addr", "127.0.0.1:0", "--database-url", ""}, args...), Stdout: io.Discard, Stderr: logs}).Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case code := <-done:
			if code != paymentsapp.ExitOK {
				t.Errorf("payments serve exited %d: %s", code, logs.String())
			}
		case <-time.After(20 * time.Second):
			t.Errorf("payments serve did not stop")
		}
	})
	listening := regexp.MustCompile(`url=(http://\S+)`)
	deadline := time.Now().Add(10 * time.Second)
	for {
		if m := listening.FindStringSubmatch(logs.String()); m != nil {
			return m[1]
		}
		select {
		case code := <-done:
			t.Fatalf("payments serve exited %d: %s", code, logs.String())
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("payments serve did not start: %s", logs.String())
		}
	}
}

// oasClosedAddr returns a loopback address that nothing listens on.
func oasClosedAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// oasCall is one request of a scenario.
type oasCall struct {
	method, path string
	auth         string // the Authorization header as it is; overrides token
	token        string // a bearer token
	key          string // Idempotency-Key; "" sends none
	body         string // JSON
	contentType  string // of the body; "" sends application/json
	extra        http.Header
	invalid      bool // the description must refuse the request
}

type oasAnswer struct {
	status int
	header http.Header
	body   []byte
	obj    map[string]any
}

func oasDo(t *testing.T, hc *http.Client, base string, c oasCall) oasAnswer {
	t.Helper()
	var rd io.Reader
	if c.body != "" {
		rd = strings.NewReader(c.body)
	}
	req, err := http.NewRequest(c.method, base+c.path, rd)
	if err != nil {
		t.Fatal(err)
	}
	switch {
	case c.auth != "":
		req.Header.Set("Authorization", c.auth)
	case c.token != "":
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	if c.key != "" {
		req.Header.Set("Idempotency-Key", c.key)
	}
	if c.body != "" {
		req.Header.Set("Content-Type", "application/json")
		if c.contentType != "" {
			req.Header.Set("Content-Type", c.contentType)
		}
	}
	for k, vs := range c.extra {
		for _, v := range vs {
			req.Header.Add(k, v)
		}
	}
	if c.invalid {
		req = oascheck.ExpectInvalid(req)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", c.method, c.path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: %v", c.method, c.path, err)
	}
	a := oasAnswer{status: resp.StatusCode, header: resp.Header, body: b}
	_ = json.Unmarshal(b, &a.obj) // a body that is not JSON leaves obj nil
	return a
}

func oasWant(t *testing.T, what string, a oasAnswer, status int) {
	t.Helper()
	if a.status != status {
		t.Fatalf("%s: status %d, want %d: %s", what, a.status, status, a.body)
	}
}

func oasWantProblem(t *testing.T, what string, a oasAnswer, status int, typ string) {
	t.Helper()
	oasWant(t, what, a, status)
	if got := a.obj["type"]; got != "https://idem-go.github.io/problems/"+typ {
		t.Errorf("%s: problem type %v, want %s", what, got, typ)
	}
}

// oasScenario sends the order service at base a request of every kind the
// order API describes, through ck. decline: the gateway declines amounts
// over 1,000,000.
func oasScenario(t *testing.T, ck *oascheck.Checker, base string, decline bool) {
	hc := ck.Client()
	hc.Timeout = 30 * time.Second
	do := func(c oasCall) oasAnswer { t.Helper(); return oasDo(t, hc, base, c) }
	tok, other := token(t, "oas-user"), token(t, "oas-other")
	body := `{"items":[{"sku":"SKU-1","quantity":2,"unit_price":1299}],"currency":"EUR"}`

	// The page, the description, health and metrics.
	a := do(oasCall{method: "GET", path: "/"})
	oasWant(t, "page", a, 200)
	a = do(oasCall{method: "GET", path: "/openapi.yaml"})
	oasWant(t, "openapi.yaml", a, 200)
	if !bytes.Equal(a.body, api.OpenAPI) || a.header.Get("Content-Type") != "application/yaml" {
		t.Errorf("GET /openapi.yaml: Content-Type %q, %d bytes, want api.OpenAPI's %d", a.header.Get("Content-Type"), len(a.body), len(api.OpenAPI))
	}
	oasWant(t, "health", do(oasCall{method: "GET", path: "/healthz"}), 200)
	a = do(oasCall{method: "GET", path: "/metrics"})
	oasWant(t, "metrics", a, 200)
	if !strings.Contains(string(a.body), "# TYPE ") {
		t.Errorf("metrics: %.300s", a.body)
	}
	a = do(oasCall{method: "POST", path: "/checkout/session"})
	firstSession := time.Now()
	oasWant(t, "guest session", a, 201)
	guest, _ := a.obj["token"].(string)
	oasWant(t, "guest lists its orders", do(oasCall{method: "GET", path: "/v1/orders", token: guest}), 200)
	a = do(oasCall{method: "GET", path: "/"})
	for _, src := range regexp.MustCompile(`(?:src|href)="(/checkout/[^"]+)"`).FindAllStringSubmatch(string(a.body), -1) {
		oasWant(t, "page file "+src[1], do(oasCall{method: "GET", path: src[1]}), 200)
	}
	oasWantProblem(t, "no such page file", do(oasCall{method: "GET", path: "/checkout/nope.js"}), 404, "not-found")

	// Unknown routes and methods.
	oasWantProblem(t, "unknown route", do(oasCall{method: "GET", path: "/v2/orders", invalid: true}), 404, "not-found")
	a = do(oasCall{method: "DELETE", path: "/v1/orders", token: tok, invalid: true})
	oasWantProblem(t, "DELETE /v1/orders", a, 405, "method-not-allowed")
	if a.header.Get("Allow") != "GET, HEAD, POST" {
		t.Errorf("DELETE /v1/orders: Allow %q", a.header.Get("Allow"))
	}
	a = do(oasCall{method: "PUT", path: "/healthz", invalid: true})
	oasWantProblem(t, "PUT /healthz", a, 405, "method-not-allowed")
	if a.header.Get("Allow") != "GET, HEAD" {
		t.Errorf("PUT /healthz: Allow %q", a.header.Get("Allow"))
	}
	oasWant(t, "GET /checkout/session", do(oasCall{method: "GET", path: "/checkout/session", invalid: true}), 405)
	// The guest sign-in's rate limit: the scenario has signed in once, and
	// the limit gave back one sign-in per SessionEvery since (a loaded
	// machine can take longer than that to get here), and may give one
	// more while this runs: the rest of the burst and those are 201, the
	// next one 429.
	refilled := int(time.Since(firstSession)/checkout.SessionEvery) + 1
	signIns := 1
	for ; signIns <= checkout.SessionBurst+refilled; signIns++ {
		a = do(oasCall{method: "POST", path: "/checkout/session"})
		if a.status != 201 {
			break
		}
	}
	if signIns < checkout.SessionBurst {
		t.Fatalf("guest session %d of a burst of %d: status %d: %s", signIns+1, checkout.SessionBurst, a.status, a.body)
	}
	oasWantProblem(t, fmt.Sprintf("too many guest sessions (%d signed in, the burst %d and at most %d given back)", signIns, checkout.SessionBurst, refilled), a, 429, "rate-limited")
	if a.header.Get("Retry-After") == "" {
		t.Errorf("429 without Retry-After: %v", a.header)
	}

	// Authentication.
	a = do(oasCall{method: "POST", path: "/v1/orders", key: "oas-noauth", body: body, invalid: true})
	oasWantProblem(t, "no token", a, 401, "unauthorized")
	if a.header.Get("WWW-Authenticate") != `Bearer realm="orders"` || a.header.Get("Idempotency-Key") != "oas-noauth" {
		t.Errorf("no token: %v", a.header)
	}
	a = do(oasCall{method: "POST", path: "/v1/orders", token: "not.a.jwt", key: "oas-badauth", body: body})
	oasWantProblem(t, "bad token", a, 401, "unauthorized")
	if !strings.Contains(a.header.Get("WWW-Authenticate"), `error="invalid_token"`) {
		t.Errorf("bad token: %v", a.header)
	}
	oasWantProblem(t, "list without token", do(oasCall{method: "GET", path: "/v1/orders", invalid: true}), 401, "unauthorized")
	oasWantProblem(t, "get with a bad token", do(oasCall{method: "GET", path: "/v1/orders/ord_x", auth: "Bearer " + token(t, "oas-user")[1:]}), 401, "unauthorized")

	// Refused before anything happens: the key stays free.
	const k1 = "oas-order-1"
	for _, c := range []struct {
		name, body, typ string
		invalid         bool
	}{
		{"bad JSON", `{"items":`, "invalid-request", true},
		{"not an object", `[1]`, "invalid-request", true},
		{"unknown field", `{"items":[{"sku":"A","quantity":1,"unit_price":1}],"currency":"EUR","coupon":"X"}`, "invalid-request", true},
		{"no items", `{"items":[],"currency":"EUR"}`, "invalid-request", true},
		{"101 items", `{"items":[` + strings.Repeat(`{"sku":"A","quantity":1,"unit_price":1},`, 100) + `{"sku":"A","quantity":1,"unit_price":1}],"currency":"EUR"}`, "invalid-request", true},
		{"empty sku", `{"items":[{"sku":"","quantity":1,"unit_price":1}],"currency":"EUR"}`, "invalid-request", true},
		{"sku of 65", `{"items":[{"sku":"` + strings.Repeat("s", 65) + `","quantity":1,"unit_price":1}],"currency":"EUR"}`, "invalid-request", true},
		{"sku with a control character", `{"items":[{"sku":"A\u0007","quantity":1,"unit_price":1}],"currency":"EUR"}`, "invalid-request", true},
		{"blank sku", `{"items":[{"sku":"   ","quantity":1,"unit_price":1}],"currency":"EUR"}`, "invalid-request", false},
		{"quantity 0", `{"items":[{"sku":"A","quantity":0,"unit_price":1}],"currency":"EUR"}`, "invalid-request", true},
		{"quantity 1001", `{"items":[{"sku":"A","quantity":1001,"unit_price":1}],"currency":"EUR"}`, "invalid-request", true},
		{"quantity 1.5", `{"items":[{"sku":"A","quantity":1.5,"unit_price":1}],"currency":"EUR"}`, "invalid-request", true},
		{"price 0", `{"items":[{"sku":"A","quantity":1,"unit_price":0}],"currency":"EUR"}`, "invalid-request", true},
		{"missing price", `{"items":[{"sku":"A","quantity":1}],"currency":"EUR"}`, "invalid-request", true},
		{"currency in lower case", `{"items":[{"sku":"A","quantity":1,"unit_price":1}],"currency":"eur"}`, "invalid-request", true},
		{"currency not ISO 4217", `{"items":[{"sku":"A","quantity":1,"unit_price":1}],"currency":"ABC"}`, "invalid-request", false},
		{"total over the limit", `{"items":[{"sku":"A","quantity":2,"unit_price":99999999}],"currency":"EUR"}`, "invalid-request", false},
		{"member repeated", `{"items":[{"sku":"A","quantity":1,"unit_price":1}],"currency":"EUR","currency":"USD"}`, "request-body-unreadable", false},
		{"member repeated in another case", `{"items":[{"sku":"A","quantity":1,"unit_price":1}],"currency":"EUR","Currency":"USD"}`, "request-body-unreadable", true},
	} {
		a := do(oasCall{method: "POST", path: "/v1/orders", token: tok, key: k1, body: c.body, invalid: c.invalid})
		oasWantProblem(t, c.name, a, 400, c.typ)
		if a.header.Get("Idempotency-Key") != k1 {
			t.Errorf("%s: Idempotency-Key echoed %q", c.name, a.header.Get("Idempotency-Key"))
		}
	}
	big := body[:len(body)-1] + strings.Repeat(" ", 1<<20) + "}"
	oasWantProblem(t, "body over 1 MiB", do(oasCall{method: "POST", path: "/v1/orders", token: tok, key: k1, body: big}), 413, "request-too-large")
	oasWantProblem(t, "no key", do(oasCall{method: "POST", path: "/v1/orders", token: tok, body: body, invalid: true}), 400, "idempotency-key-missing")
	for _, bad := range []string{"a b", `"unterminated`, `"a"b"`, `"a b"`, strings.Repeat("k", 256)} {
		a := do(oasCall{method: "POST", path: "/v1/orders", token: tok, key: bad, body: body, invalid: true})
		oasWantProblem(t, "key "+bad, a, 400, "idempotency-key-invalid")
	}

	a = do(oasCall{method: "POST", path: "/v1/orders", token: tok, key: k1, body: body, extra: http.Header{"Idempotency-Key": {"oas-second-key"}}})
	oasWantProblem(t, "two keys", a, 400, "idempotency-key-invalid")
	a = do(oasCall{method: "POST", path: "/v1/orders", token: tok, key: k1, body: body, contentType: "text/plain", invalid: true})
	oasWantProblem(t, "text/plain", a, 415, "unsupported-media-type")
	if a.header.Get("Accept-Post") != "application/json" {
		t.Errorf("415: Accept-Post %q", a.header.Get("Accept-Post"))
	}

	// Create (with the key the refused requests left free), replay,
	// reuse with another body.
	a = do(oasCall{method: "POST", path: "/v1/orders", token: tok, key: k1, body: body})
	oasWant(t, "create", a, 201)
	first := a
	id, _ := a.obj["id"].(string)
	if a.header.Get("Location") != "/v1/orders/"+id || a.obj["total"] != 2598.0 || a.obj["status"] != "paid" {
		t.Errorf("create: %v %s", a.header, a.body)
	}
	reordered := `{ "currency": "EUR", "items": [ { "unit_price": 1299, "quantity": 2, "sku": "SKU-1" } ] }`
	a = do(oasCall{method: "POST", path: "/v1/orders", token: tok, key: `"` + k1 + `"`, body: reordered})
	oasWant(t, "replay", a, 201)
	if !bytes.Equal(a.body, first.body) || a.header.Get("Idempotent-Replayed") != "true" ||
		a.header.Get("Location") != first.header.Get("Location") || a.header.Get("Idempotency-Key") != `"`+k1+`"` {
		t.Errorf("replay: %v %s", a.header, a.body)
	}
	a = do(oasCall{method: "POST", path: "/v1/orders", token: tok, key: k1, body: strings.Replace(body, `"quantity":2`, `"quantity":3`, 1)})
	oasWantProblem(t, "key reused with another body", a, 422, "idempotency-key-mismatch")

	// A repeat while the first is in flight (the gateway takes a second).
	var wg sync.WaitGroup
	answers := make([]oasAnswer, 2)
	errs := make([]error, 2)
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("POST", base+"/v1/orders", strings.NewReader(orderBody(2)))
			req.Header.Set("Authorization", "Bearer "+tok)
			req.Header.Set("Idempotency-Key", "oas-flight")
			req.Header.Set("Content-Type", "application/json")
			resp, err := hc.Do(req)
			if err != nil {
				errs[i] = err
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			answers[i] = oasAnswer{status: resp.StatusCode, header: resp.Header, body: b}
		}()
	}
	wg.Wait()
	if s0, s1 := answers[0].status, answers[1].status; errs[0] != nil || errs[1] != nil || !(s0 == 201 && s1 == 409 || s0 == 409 && s1 == 201) {
		t.Errorf("two requests with one key at once: %d %s %v; %d %s %v", s0, answers[0].body, errs[0], s1, answers[1].body, errs[1])
	}
	for _, a := range answers {
		if a.status == 409 && a.header.Get("Retry-After") == "" {
			t.Errorf("409 without Retry-After: %v", a.header)
		}
	}

	if decline {
		over := `{"items":[{"sku":"BIG","quantity":1000,"unit_price":1001}],"currency":"EUR"}`
		a = do(oasCall{method: "POST", path: "/v1/orders", token: tok, key: "oas-decline", body: over})
		oasWantProblem(t, "declined", a, 402, "payment-declined")
		a = do(oasCall{method: "POST", path: "/v1/orders", token: tok, key: "oas-decline", body: over})
		oasWantProblem(t, "declined, replayed", a, 402, "payment-declined")
		if a.header.Get("Idempotent-Replayed") != "true" {
			t.Errorf("declined, replayed: %v", a.header)
		}
	}
	oasWant(t, "third order", do(oasCall{method: "POST", path: "/v1/orders", token: tok, key: "oas-order-3", body: orderBody(3)}), 201)

	// List, page, get.
	a = do(oasCall{method: "GET", path: "/v1/orders?limit=1", token: tok})
	oasWant(t, "list", a, 200)
	if a.obj["has_more"] != true {
		t.Errorf("list limit=1: %s", a.body)
	}
	a = do(oasCall{method: "GET", path: "/v1/orders?limit=2&starting_after=" + id, token: tok})
	oasWant(t, "list after the first order", a, 200)
	if a.obj["has_more"] != false {
		t.Errorf("list after the first order: %s", a.body)
	}
	a = do(oasCall{method: "GET", path: "/v1/orders", token: tok, key: "echo-me"})
	oasWant(t, "list with a key", a, 200)
	if orders, _ := a.obj["orders"].([]any); len(orders) != 3 || a.header.Get("Idempotency-Key") != "echo-me" {
		t.Errorf("list: %v %s", a.header, a.body)
	}
	oasWantProblem(t, "limit 0", do(oasCall{method: "GET", path: "/v1/orders?limit=0", token: tok, invalid: true}), 400, "invalid-request")
	oasWantProblem(t, "limit 101", do(oasCall{method: "GET", path: "/v1/orders?limit=101", token: tok, invalid: true}), 400, "invalid-request")
	oasWantProblem(t, "limit x", do(oasCall{method: "GET", path: "/v1/orders?limit=x", token: tok, invalid: true}), 400, "invalid-request")
	oasWantProblem(t, "unknown cursor", do(oasCall{method: "GET", path: "/v1/orders?starting_after=ord_nope", token: tok}), 400, "invalid-request")
	a = do(oasCall{method: "GET", path: "/v1/orders/" + id, token: tok})
	oasWant(t, "get", a, 200)
	if a.obj["id"] != id {
		t.Errorf("get: %s", a.body)
	}
	oasWantProblem(t, "another user's order", do(oasCall{method: "GET", path: "/v1/orders/" + id, token: other}), 404, "not-found")
	oasWantProblem(t, "no such order", do(oasCall{method: "GET", path: "/v1/orders/ord_000000000000000000000000", token: tok}), 404, "not-found")
	oasWantProblem(t, "get without token", do(oasCall{method: "GET", path: "/v1/orders/" + id, invalid: true}), 401, "unauthorized")
	if t.Failed() {
		t.Logf("errors so far: %s", strings.Join(ck.Errors(), "\n"))
	}
}
