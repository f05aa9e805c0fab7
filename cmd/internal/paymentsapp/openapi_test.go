package paymentsapp

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/oascheck"
	"github.com/idem-go/idem/cmd/internal/payments"
)

// oasStartGateway runs `payments serve` in process on a free loopback
// port with args and env, and returns its base URL; it stops when t ends.
func oasStartGateway(t *testing.T, env map[string]string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stderr := new(syncBuffer)
	done := make(chan int, 1)
	go func() {
		done <- runCLI(ctx, append([]string{"serve", "--addr", "127.0.0.1:0"}, args...), envOf(env), new(bytes.Buffer), stderr)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case code := <-done:
			if code != ExitOK {
				t.Errorf("payments serve exited %d: %s", code, stderr.String())
			}
		case <-time.After(20 * time.Second):
			t.Errorf("payments serve did not stop")
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		if m := listeningRE.FindStringSubmatch(stderr.String()); m != nil {
			return m[1]
		}
		select {
		case code := <-done:
			t.Fatalf("payments serve exited %d: %s", code, stderr.String())
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("payments serve did not start: %s", stderr.String())
		}
	}
}

// oasCall is one request of a scenario.
type oasCall struct {
	method, path string
	auth         string // the Authorization header; "" sends none
	key          string // Idempotency-Key; "" sends none
	form         url.Values
	ctype, body  string // a raw body instead of form
	invalid      bool   // the description must refuse the request
}

type oasAnswer struct {
	status int
	header http.Header
	body   []byte
	obj    map[string]any
}

// field returns the string at a path of object members.
func (a oasAnswer) field(path ...string) string {
	var v any = a.obj
	for _, p := range path {
		m, _ := v.(map[string]any)
		v = m[p]
	}
	s, _ := v.(string)
	return s
}

func oasDo(t *testing.T, hc *http.Client, base string, c oasCall) oasAnswer {
	t.Helper()
	body, ctype := c.body, c.ctype
	if c.form != nil {
		body, ctype = c.form.Encode(), "application/x-www-form-urlencoded"
	}
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(c.method, base+c.path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if c.auth != "" {
		req.Header.Set("Authorization", c.auth)
	}
	if c.key != "" {
		req.Header.Set("Idempotency-Key", c.key)
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
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

// TestGatewayMatchesOpenAPI drives a real `payments serve` through every route of
// the gateway's part of cmd/internal/api/openapi.yaml, with raw requests and with the
// gateway's stripe-go client, and checks every request and response
// against the description.
func TestGatewayMatchesOpenAPI(t *testing.T) {
	const sk = "Bearer sk_test_oas"
	base := oasStartGateway(t, nil, "--decline-over", "500000")
	slow := oasStartGateway(t, nil, "--latency", "4s")
	ck, err := oascheck.New(oascheck.Addrs{Gateway: []string{base, slow}})
	if err != nil {
		t.Fatal(err)
	}
	hc := ck.Client()
	hc.Timeout = 30 * time.Second
	do := func(c oasCall) oasAnswer { t.Helper(); return oasDo(t, hc, base, c) }
	pay := func(amount, method string) url.Values {
		return url.Values{"amount": {amount}, "currency": {"eur"}, "confirm": {"true"}, "payment_method": {method},
			"metadata[order_ref]": {"ord_oas"}, "description": {"oas scenario"}}
	}

	// Authentication.
	a := do(oasCall{method: "GET", path: "/v1/payment_intents", invalid: true})
	oasWant(t, "no key", a, 401)
	a = do(oasCall{method: "GET", path: "/v1/payment_intents", auth: "Bearer sk_live_nope"})
	oasWant(t, "wrong key", a, 401)
	if a.field("error", "type") != "invalid_request_error" || a.header.Get("WWW-Authenticate") == "" {
		t.Errorf("wrong key: %v %s", a.header, a.body)
	}
	oasWant(t, "pay with a wrong key", do(oasCall{method: "POST", path: "/v1/payment_intents", auth: "Bearer sk_test_", key: "oas-401", form: pay("100", "pm_card_visa")}), 401)
	a = do(oasCall{method: "GET", path: "/v1/payment_intents?limit=1", auth: "Basic c2tfdGVzdF9vYXM6"}) // sk_test_oas:
	oasWant(t, "basic auth", a, 200)

	// Unknown routes and methods.
	oasWant(t, "unknown route", do(oasCall{method: "GET", path: "/v1/charges", auth: sk, invalid: true}), 404)
	oasWant(t, "unknown method", do(oasCall{method: "DELETE", path: "/v1/payment_intents", auth: sk, invalid: true}), 404)

	// Pay, replay, reuse the key with other parameters.
	a = do(oasCall{method: "POST", path: "/v1/payment_intents", auth: sk, key: "oas-pay-1", form: pay("2598", "pm_card_visa")})
	oasWant(t, "pay", a, 200)
	pi := a.field("id")
	if a.field("status") != "succeeded" || a.header.Get("Idempotency-Key") != "oas-pay-1" {
		t.Errorf("pay: %v %s", a.header, a.body)
	}
	a = do(oasCall{method: "POST", path: "/v1/payment_intents", auth: sk, key: `"oas-pay-1"`, form: pay("2598", "pm_card_visa")})
	oasWant(t, "replay", a, 200)
	if a.field("id") != pi || a.header.Get("Idempotent-Replayed") != "true" || a.header.Get("Idempotency-Key") != `"oas-pay-1"` {
		t.Errorf("replay: %v %s", a.header, a.body)
	}
	a = do(oasCall{method: "POST", path: "/v1/payment_intents", auth: sk, key: "oas-pay-1", form: pay("2599", "pm_card_visa")})
	oasWant(t, "key reused", a, 400)
	if a.field("error", "type") != "idempotency_error" {
		t.Errorf("key reused: %s", a.body)
	}
	// Without a key: not idempotent, still valid.
	oasWant(t, "pay without key", do(oasCall{method: "POST", path: "/v1/payment_intents", auth: sk, form: pay("100", "pm_card_mastercard")}), 200)

	// Declines: the payment method, and an amount over --decline-over.
	a = do(oasCall{method: "POST", path: "/v1/payment_intents", auth: sk, key: "oas-decline-1", form: pay("100", "pm_card_chargeDeclined")})
	oasWant(t, "decline", a, 402)
	declined := a.field("error", "payment_intent", "id")
	if a.field("error", "code") != "card_declined" || declined == "" {
		t.Errorf("decline: %s", a.body)
	}
	a = do(oasCall{method: "POST", path: "/v1/payment_intents", auth: sk, key: "oas-decline-1", form: pay("100", "pm_card_chargeDeclined")})
	oasWant(t, "decline replayed", a, 402)
	if a.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("decline replay: %v", a.header)
	}
	a = do(oasCall{method: "POST", path: "/v1/payment_intents", auth: sk, key: "oas-decline-2", form: pay("500001", "pm_card_visa")})
	oasWant(t, "decline over limit", a, 402)
	if a.field("error", "decline_code") != "insufficient_funds" {
		t.Errorf("decline over limit: %s", a.body)
	}

	// Invalid requests: the description refuses those it can tell.
	for _, c := range []struct {
		name string
		call oasCall
	}{
		{"amount 0", oasCall{form: pay("0", "pm_card_visa"), invalid: true}},
		{"amount too large", oasCall{form: pay("100000000", "pm_card_visa"), invalid: true}},
		{"amount not an integer", oasCall{form: pay("12.5", "pm_card_visa"), invalid: true}},
		{"unknown payment method", oasCall{form: pay("100", "pm_card_nope"), invalid: true}},
		{"currency not a code", oasCall{form: func() url.Values { v := pay("100", "pm_card_visa"); v.Set("currency", "euro"); return v }(), invalid: true}},
		{"currency unknown", oasCall{form: func() url.Values { v := pay("100", "pm_card_visa"); v.Set("currency", "zzz"); return v }()}},
		{"confirm false", oasCall{form: func() url.Values { v := pay("100", "pm_card_visa"); v.Set("confirm", "false"); return v }(), invalid: true}},
		{"missing amount", oasCall{form: func() url.Values { v := pay("100", "pm_card_visa"); v.Del("amount"); return v }(), invalid: true}},
		{"description too long", oasCall{form: func() url.Values {
			v := pay("100", "pm_card_visa")
			v.Set("description", strings.Repeat("d", payments.MaxDescriptionLen+1))
			return v
		}(), invalid: true}},
		{"metadata key too long", oasCall{form: func() url.Values {
			v := pay("100", "pm_card_visa")
			v.Set("metadata["+strings.Repeat("m", payments.MaxMetadataKeyLen+1)+"]", "x")
			return v
		}(), invalid: true}},
		{"metadata value too long", oasCall{form: func() url.Values {
			v := pay("100", "pm_card_visa")
			v.Set("metadata[k]", strings.Repeat("v", payments.MaxMetadataValueLen+1))
			return v
		}(), invalid: true}},
		{"automatic_payment_methods[allow_redirects] unknown", oasCall{form: func() url.Values {
			v := pay("100", "pm_card_visa")
			v.Set("automatic_payment_methods[allow_redirects]", "sometimes")
			return v
		}(), invalid: true}},
		{"unknown parameter", oasCall{form: func() url.Values { v := pay("100", "pm_card_visa"); v.Set("customer", "cus_1"); return v }()}},
		{"JSON body", oasCall{ctype: "application/json", body: `{"amount":100}`, invalid: true}},
		{"bad key", oasCall{key: "a b", form: pay("100", "pm_card_visa"), invalid: true}},
		{"bad sf-string key", oasCall{key: `"open`, form: pay("100", "pm_card_visa"), invalid: true}},
	} {
		c.call.method, c.call.path, c.call.auth = "POST", "/v1/payment_intents", sk
		if c.call.key == "" {
			c.call.key = "oas-invalid-" + strings.ReplaceAll(c.name, " ", "-")
		}
		a := do(c.call)
		oasWant(t, c.name, a, 400)
		if a.field("error", "type") != "invalid_request_error" {
			t.Errorf("%s: %s", c.name, a.body)
		}
	}
	big := pay("100", "pm_card_visa")
	big.Set("description", strings.Repeat("x", payments.MaxRequestBody))
	oasWant(t, "body too large", do(oasCall{method: "POST", path: "/v1/payment_intents", auth: sk, key: "oas-big", form: big, invalid: true}), 413)
	oasWant(t, "body too large, no key", do(oasCall{method: "POST", path: "/v1/payment_intents", auth: sk, form: big, invalid: true}), 413)

	// Lists, pages and one PaymentIntent.
	a = do(oasCall{method: "GET", path: "/v1/payment_intents?limit=1", auth: sk})
	oasWant(t, "list", a, 200)
	if a.obj["has_more"] != true {
		t.Errorf("list limit=1: %s", a.body)
	}
	oasWant(t, "list page 2", do(oasCall{method: "GET", path: "/v1/payment_intents?limit=2&starting_after=" + pi, auth: sk}), 200)
	oasWant(t, "list ending_before", do(oasCall{method: "GET", path: "/v1/payment_intents?ending_before=" + pi, auth: sk}), 200)
	oasWant(t, "list limit 0", do(oasCall{method: "GET", path: "/v1/payment_intents?limit=0", auth: sk, invalid: true}), 400)
	oasWant(t, "list limit 101", do(oasCall{method: "GET", path: "/v1/payment_intents?limit=101", auth: sk, invalid: true}), 400)
	oasWant(t, "list unknown cursor", do(oasCall{method: "GET", path: "/v1/payment_intents?starting_after=pi_nope", auth: sk}), 400)
	a = do(oasCall{method: "GET", path: "/v1/payment_intents/" + pi, auth: sk})
	oasWant(t, "get", a, 200)
	if a.field("metadata", "order_ref") != "ord_oas" || a.field("description") != "oas scenario" {
		t.Errorf("get: %s", a.body)
	}
	oasWant(t, "get declined", do(oasCall{method: "GET", path: "/v1/payment_intents/" + declined, auth: sk}), 200)
	oasWant(t, "get missing", do(oasCall{method: "GET", path: "/v1/payment_intents/pi_nope", auth: sk}), 404)

	// Search.
	q := url.QueryEscape(`metadata['order_ref']:'ord_oas' AND status:'succeeded'`)
	a = do(oasCall{method: "GET", path: "/v1/payment_intents/search?limit=1&query=" + q, auth: sk})
	oasWant(t, "search", a, 200)
	if a.obj["has_more"] != true || a.field("next_page") == "" {
		t.Errorf("search limit=1: %s", a.body)
	}
	oasWant(t, "search page 2", do(oasCall{method: "GET", path: "/v1/payment_intents/search?page=" + a.field("next_page") + "&query=" + q, auth: sk}), 200)
	oasWant(t, "search bad query", do(oasCall{method: "GET", path: "/v1/payment_intents/search?query=" + url.QueryEscape("amount>3"), auth: sk}), 400)
	oasWant(t, "search without query", do(oasCall{method: "GET", path: "/v1/payment_intents/search", auth: sk, invalid: true}), 400)

	// Refunds.
	refund := func(v url.Values) url.Values { return v }
	a = do(oasCall{method: "POST", path: "/v1/refunds", auth: sk, key: "oas-refund-1", form: refund(url.Values{"payment_intent": {pi}, "amount": {"598"}, "reason": {"requested_by_customer"}, "metadata[note]": {"oas"}})})
	oasWant(t, "refund", a, 200)
	re := a.field("id")
	a = do(oasCall{method: "POST", path: "/v1/refunds", auth: sk, key: "oas-refund-1", form: url.Values{"payment_intent": {pi}, "amount": {"598"}, "reason": {"requested_by_customer"}, "metadata[note]": {"oas"}}})
	oasWant(t, "refund replayed", a, 200)
	if a.field("id") != re || a.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("refund replay: %v %s", a.header, a.body)
	}
	oasWant(t, "refund key reused", do(oasCall{method: "POST", path: "/v1/refunds", auth: sk, key: "oas-refund-1", form: url.Values{"payment_intent": {pi}}}), 400)
	a = do(oasCall{method: "POST", path: "/v1/refunds", auth: sk, key: "oas-refund-2", form: url.Values{"payment_intent": {pi}, "amount": {"2001"}}})
	oasWant(t, "refund too large", a, 400)
	if a.field("error", "code") != "amount_too_large" {
		t.Errorf("refund too large: %s", a.body)
	}
	oasWant(t, "refund the rest", do(oasCall{method: "POST", path: "/v1/refunds", auth: sk, key: "oas-refund-3", form: url.Values{"payment_intent": {pi}}}), 200)
	a = do(oasCall{method: "POST", path: "/v1/refunds", auth: sk, key: "oas-refund-4", form: url.Values{"payment_intent": {pi}}})
	oasWant(t, "refund again", a, 400)
	if a.field("error", "code") != "charge_already_refunded" {
		t.Errorf("refund again: %s", a.body)
	}
	a = do(oasCall{method: "POST", path: "/v1/refunds", auth: sk, key: "oas-refund-5", form: url.Values{"payment_intent": {declined}}})
	oasWant(t, "refund a decline", a, 400)
	if a.field("error", "code") != "payment_intent_unexpected_state" {
		t.Errorf("refund a decline: %s", a.body)
	}
	oasWant(t, "refund missing", do(oasCall{method: "POST", path: "/v1/refunds", auth: sk, key: "oas-refund-6", form: url.Values{"payment_intent": {"pi_nope"}}}), 404)
	oasWant(t, "refund without payment_intent", do(oasCall{method: "POST", path: "/v1/refunds", auth: sk, key: "oas-refund-7", form: url.Values{"amount": {"1"}}, invalid: true}), 400)
	oasWant(t, "refund bad reason", do(oasCall{method: "POST", path: "/v1/refunds", auth: sk, key: "oas-refund-8", form: url.Values{"payment_intent": {pi}, "reason": {"bored"}}, invalid: true}), 400)
	oasWant(t, "refund too large body", do(oasCall{method: "POST", path: "/v1/refunds", auth: sk, key: "oas-refund-9", form: url.Values{"payment_intent": {pi}, "metadata[x]": {strings.Repeat("x", payments.MaxRequestBody)}}, invalid: true}), 413)
	a = do(oasCall{method: "GET", path: "/v1/refunds?payment_intent=" + pi + "&limit=1", auth: sk})
	oasWant(t, "list refunds", a, 200)
	if a.obj["has_more"] != true {
		t.Errorf("list refunds limit=1: %s", a.body)
	}
	oasWant(t, "list all refunds", do(oasCall{method: "GET", path: "/v1/refunds", auth: sk}), 200)
	oasWant(t, "list refunds unknown cursor", do(oasCall{method: "GET", path: "/v1/refunds?starting_after=re_nope", auth: sk}), 400)
	oasWant(t, "list refunds both cursors", do(oasCall{method: "GET", path: "/v1/refunds?starting_after=" + re + "&ending_before=" + re, auth: sk}), 400)

	// A repeat while the first still runs (4s at the slow gateway) waits
	// 2s for it and is answered 429 lock_timeout, which clients retry.
	var wg sync.WaitGroup
	answers := make([]oasAnswer, 2)
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("POST", slow+"/v1/payment_intents", strings.NewReader(pay("100", "pm_card_visa").Encode()))
			req.Header.Set("Authorization", sk)
			req.Header.Set("Idempotency-Key", "oas-slow-1")
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			resp, err := hc.Do(req)
			if err != nil {
				answers[i] = oasAnswer{body: []byte(err.Error())}
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			answers[i] = oasAnswer{status: resp.StatusCode, header: resp.Header, body: b}
		}()
	}
	wg.Wait()
	if s0, s1 := answers[0].status, answers[1].status; !(s0 == 200 && s1 == 429 || s0 == 429 && s1 == 200) {
		t.Errorf("two requests with one key at once: %d %s; %d %s", s0, answers[0].body, s1, answers[1].body)
	}
	for _, a := range answers {
		if a.status == 429 && a.header.Get("Stripe-Should-Retry") != "true" {
			t.Errorf("429 without Stripe-Should-Retry: %v", a.header)
		}
	}

	// The gateway's stripe-go client, as the order service uses it.
	cl := payments.NewClient(payments.ClientConfig{BaseURL: base, APIKey: "sk_test_oas", HTTPClient: hc, MaxNetworkRetries: -1})
	ctx := context.Background()
	ch, err := cl.Charge(ctx, payments.ChargeRequest{Amount: 1299, Currency: "EUR", IdempotencyKey: "oas-client-1", Metadata: map[string]string{"order_ref": "ord_oas_client"}})
	if err != nil {
		t.Fatalf("client charge: %v", err)
	}
	if _, err := cl.Charge(ctx, payments.ChargeRequest{Amount: 1299, Currency: "EUR", PaymentMethod: "pm_card_chargeDeclined", IdempotencyKey: "oas-client-2"}); err == nil {
		t.Errorf("client charge with a declined card: no error")
	}
	if got, err := cl.FindByOrderRef(ctx, "ord_oas_client"); err != nil || got == nil || got.ID != ch.ID {
		t.Errorf("client FindByOrderRef = %v, %v; want %s", got, err, ch.ID)
	}
	if _, err := cl.Get(ctx, ch.ID); err != nil {
		t.Errorf("client get: %v", err)
	}
	n := 0
	for _, err := range cl.All(ctx) {
		if err != nil {
			t.Fatalf("client list: %v", err)
		}
		n++
	}
	if n < 5 {
		t.Errorf("client list: %d PaymentIntents", n)
	}
	if _, err := cl.Refund(ctx, payments.RefundRequest{PaymentIntent: ch.ID, IdempotencyKey: "oas-client-refund"}); err != nil {
		t.Errorf("client refund: %v", err)
	}
	if rs, err := cl.Refunds(ctx, ch.ID); err != nil || len(rs) != 1 {
		t.Errorf("client refunds = %v, %v", rs, err)
	}

	ck.Report(t)
	ck.RequireAllOperations(t, true)
	ck.RequireSeen(t,
		"POST /v1/payment_intents 200", "POST /v1/payment_intents 400", "POST /v1/payment_intents 401",
		"POST /v1/payment_intents 402", "POST /v1/payment_intents 413", "POST /v1/payment_intents 429",
		"GET /v1/payment_intents 200", "GET /v1/payment_intents 400", "GET /v1/payment_intents 401",
		"GET /v1/payment_intents/{id} 200", "GET /v1/payment_intents/{id} 404",
		"GET /v1/payment_intents/search 200", "GET /v1/payment_intents/search 400",
		"POST /v1/refunds 200", "POST /v1/refunds 400", "POST /v1/refunds 404", "POST /v1/refunds 413",
		"GET /v1/refunds 200", "GET /v1/refunds 400",
		"GET (no route) 404", "DELETE (no route) 404",
	)
	t.Logf("exchanges checked: %v", ck.Seen())
}
