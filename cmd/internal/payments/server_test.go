package payments

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/testwait"
)

const testKey = "sk_test_alice"

type testBundle struct {
	gw      *Server
	ledger  *MemLedger
	metrics *idem.Metrics
}

// setup starts a gateway configured by cfg behind a real HTTP server.
func setup(t *testing.T, cfg Config) (*httptest.Server, *testBundle) {
	t.Helper()
	b := &testBundle{ledger: NewMemLedger(), metrics: new(idem.Metrics)}
	if cfg.Ledger == nil {
		cfg.Ledger = b.ledger
	}
	cfg.Metrics = b.metrics
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	b.gw = NewServer(cfg)
	srv := httptest.NewServer(b.gw)
	t.Cleanup(srv.Close)
	return srv, b
}

// chargeForm is a valid create request.
func chargeForm(amount int64, pm string) url.Values {
	return url.Values{
		"amount":              {fmt.Sprint(amount)},
		"currency":            {"eur"},
		"confirm":             {"true"},
		"payment_method":      {pm},
		"metadata[order_ref]": {"ord_1"},
	}
}

type result struct {
	status int
	header http.Header
	body   []byte
}

// do sends one request; key and apiKey are left out when empty.
func do(t *testing.T, c *http.Client, method, u, apiKey, key, body string) result {
	t.Helper()
	req, err := http.NewRequest(method, u, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, u, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return result{resp.StatusCode, resp.Header, b}
}

func create(t *testing.T, srv *httptest.Server, key string, form url.Values) result {
	t.Helper()
	return do(t, srv.Client(), http.MethodPost, srv.URL+"/v1/payment_intents", testKey, key, form.Encode())
}

// post is create for goroutines other than the test's: it returns its
// error instead of failing the test.
func post(srv *httptest.Server, apiKey, key string, form url.Values) (result, error) {
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/payment_intents", strings.NewReader(form.Encode()))
	if err != nil {
		return result{}, err
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Authorization", "Bearer "+apiKey)
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		return result{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return result{resp.StatusCode, resp.Header, b}, err
}

func decodePI(t *testing.T, b []byte) *PaymentIntent {
	t.Helper()
	var pi PaymentIntent
	if err := json.Unmarshal(b, &pi); err != nil {
		t.Fatalf("decoding PaymentIntent %s: %v", b, err)
	}
	return &pi
}

func decodeErr(t *testing.T, b []byte) *PaymentError {
	t.Helper()
	var e struct {
		Error *PaymentError `json:"error"`
	}
	if err := json.Unmarshal(b, &e); err != nil || e.Error == nil {
		t.Fatalf("decoding error body %s: %v", b, err)
	}
	return e.Error
}

func wantStatus(t *testing.T, r result, want int) {
	t.Helper()
	if r.status != want {
		t.Fatalf("status = %d, want %d; body %s", r.status, want, r.body)
	}
}

func ledgerAll(t *testing.T, l Ledger, apiKey string) []*PaymentIntent {
	t.Helper()
	all, err := ListAll(context.Background(), l, AccountFor(apiKey))
	if err != nil {
		t.Fatal(err)
	}
	return all
}

func TestCreate(t *testing.T) {
	srv, b := setup(t, Config{})
	before := time.Now().Unix()
	r := create(t, srv, "key-1", chargeForm(1299, "pm_card_visa"))
	wantStatus(t, r, http.StatusOK)
	pi := decodePI(t, r.body)
	if !strings.HasPrefix(pi.ID, "pi_") {
		t.Errorf("id = %q, want pi_…", pi.ID)
	}
	if got, want := pi.Object, "payment_intent"; got != want {
		t.Errorf("object = %q, want %q", got, want)
	}
	if got, want := pi.Amount, int64(1299); got != want {
		t.Errorf("amount = %d, want %d", got, want)
	}
	if got, want := pi.Currency, "eur"; got != want {
		t.Errorf("currency = %q, want %q", got, want)
	}
	if got, want := pi.Status, StatusSucceeded; got != want {
		t.Errorf("status = %q, want %q", got, want)
	}
	if got, want := pi.Metadata["order_ref"], "ord_1"; got != want {
		t.Errorf("metadata[order_ref] = %q, want %q", got, want)
	}
	if pi.Created < before || pi.Created > time.Now().Unix() {
		t.Errorf("created = %d, want about %d", pi.Created, before)
	}
	if got := r.header.Get("Idempotent-Replayed"); got != "" {
		t.Errorf("Idempotent-Replayed = %q on a first request", got)
	}
	if got := r.header.Get("Request-Id"); !strings.HasPrefix(got, "req_") {
		t.Errorf("Request-Id = %q, want req_…", got)
	}
	if got, want := r.header.Get("Idempotency-Key"), "key-1"; got != want {
		t.Errorf("Idempotency-Key = %q, want %q", got, want)
	}
	if got, want := r.header.Get("Content-Type"), "application/json"; got != want {
		t.Errorf("Content-Type = %q, want %q", got, want)
	}

	g := do(t, srv.Client(), http.MethodGet, srv.URL+"/v1/payment_intents/"+pi.ID, testKey, "", "")
	wantStatus(t, g, http.StatusOK)
	if got := decodePI(t, g.body); got.ID != pi.ID || got.Status != StatusSucceeded {
		t.Errorf("GET = %+v, want %s succeeded", got, pi.ID)
	}
	if got, want := b.ledger.Len(), 1; got != want {
		t.Errorf("ledger holds %d, want %d", got, want)
	}
}

func TestCreateUpperCaseCurrency(t *testing.T) {
	srv, _ := setup(t, Config{})
	f := chargeForm(100, "pm_card_visa")
	f.Set("currency", "USD")
	r := create(t, srv, "k", f)
	wantStatus(t, r, http.StatusOK)
	if got, want := decodePI(t, r.body).Currency, "usd"; got != want {
		t.Errorf("currency = %q, want %q", got, want)
	}
}

func TestReplay(t *testing.T) {
	srv, b := setup(t, Config{})
	first := create(t, srv, "key-1", chargeForm(500, "pm_card_visa"))
	wantStatus(t, first, http.StatusOK)
	for i := range 3 {
		again := create(t, srv, "key-1", chargeForm(500, "pm_card_visa"))
		wantStatus(t, again, http.StatusOK)
		if got, want := again.header.Get("Idempotent-Replayed"), "true"; got != want {
			t.Errorf("replay %d: Idempotent-Replayed = %q, want %q", i, got, want)
		}
		if string(again.body) != string(first.body) {
			t.Errorf("replay %d: body\n%s\nwant\n%s", i, again.body, first.body)
		}
		if got, want := again.header.Get("Original-Request"), first.header.Get("Request-Id"); got != want {
			t.Errorf("replay %d: Original-Request = %q, want %q", i, got, want)
		}
		if again.header.Get("Request-Id") == first.header.Get("Request-Id") {
			t.Errorf("replay %d: Request-Id repeated", i)
		}
	}
	if got, want := len(ledgerAll(t, b.ledger, testKey)), 1; got != want {
		t.Errorf("PaymentIntents = %d, want %d", got, want)
	}
	l := do(t, srv.Client(), http.MethodGet, srv.URL+"/v1/payment_intents", testKey, "", "")
	wantStatus(t, l, http.StatusOK)
	var list listObject
	if err := json.Unmarshal(l.body, &list); err != nil {
		t.Fatal(err)
	}
	if got, want := len(list.Data), 1; got != want {
		t.Errorf("listed %d, want %d", got, want)
	}
}

func TestReplayParameterOrder(t *testing.T) {
	srv, b := setup(t, Config{})
	c := srv.Client()
	u := srv.URL + "/v1/payment_intents"
	first := do(t, c, http.MethodPost, u, testKey, "k", "amount=700&currency=eur&confirm=true&payment_method=pm_card_visa&metadata[a]=1&metadata[b]=2")
	wantStatus(t, first, http.StatusOK)
	again := do(t, c, http.MethodPost, u, testKey, "k", "metadata%5Bb%5D=2&payment_method=pm_card_visa&confirm=true&metadata%5Ba%5D=1&currency=eur&amount=700")
	wantStatus(t, again, http.StatusOK)
	if got, want := again.header.Get("Idempotent-Replayed"), "true"; got != want {
		t.Errorf("Idempotent-Replayed = %q, want %q", got, want)
	}
	if got, want := b.ledger.Len(), 1; got != want {
		t.Errorf("ledger holds %d, want %d", got, want)
	}
}

func TestKeyReusedWithOtherParams(t *testing.T) {
	srv, b := setup(t, Config{})
	wantStatus(t, create(t, srv, "k", chargeForm(500, "pm_card_visa")), http.StatusOK)
	r := create(t, srv, "k", chargeForm(501, "pm_card_visa"))
	wantStatus(t, r, http.StatusBadRequest)
	if got, want := decodeErr(t, r.body).Type, "idempotency_error"; got != want {
		t.Errorf("error type = %q, want %q", got, want)
	}
	if got, want := b.ledger.Len(), 1; got != want {
		t.Errorf("ledger holds %d, want %d", got, want)
	}
}

func TestKeysScopedPerAccount(t *testing.T) {
	srv, b := setup(t, Config{})
	c := srv.Client()
	u := srv.URL + "/v1/payment_intents"
	body := chargeForm(500, "pm_card_visa").Encode()
	a := do(t, c, http.MethodPost, u, "sk_test_alice", "same", body)
	bob := do(t, c, http.MethodPost, u, "sk_test_bob", "same", body)
	wantStatus(t, a, http.StatusOK)
	wantStatus(t, bob, http.StatusOK)
	if bob.header.Get("Idempotent-Replayed") != "" {
		t.Error("bob's request was replayed from alice's key")
	}
	if got, want := b.ledger.Len(), 2; got != want {
		t.Errorf("ledger holds %d, want %d", got, want)
	}
	// Bob does not see alice's PaymentIntent.
	id := decodePI(t, a.body).ID
	g := do(t, c, http.MethodGet, u+"/"+id, "sk_test_bob", "", "")
	wantStatus(t, g, http.StatusNotFound)
	if got, want := len(ledgerAll(t, b.ledger, "sk_test_bob")), 1; got != want {
		t.Errorf("bob lists %d, want %d", got, want)
	}
}

func TestDecline(t *testing.T) {
	for _, tc := range []struct {
		name        string
		cfg         Config
		amount      int64
		pm          string
		declineCode string
	}{
		{"payment method", Config{}, 500, "pm_card_chargeDeclined", "generic_decline"},
		{"over the limit", Config{DeclineOver: 1000}, 1001, "pm_card_visa", "insufficient_funds"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, b := setup(t, tc.cfg)
			r := create(t, srv, "k", chargeForm(tc.amount, tc.pm))
			wantStatus(t, r, http.StatusPaymentRequired)
			e := decodeErr(t, r.body)
			if e.Type != "card_error" || e.Code != "card_declined" || e.DeclineCode != tc.declineCode {
				t.Errorf("error = %s/%s/%s, want card_error/card_declined/%s", e.Type, e.Code, e.DeclineCode, tc.declineCode)
			}
			if e.PaymentIntent == nil {
				t.Fatal("error has no payment_intent")
			}
			if got, want := e.PaymentIntent.Status, StatusRequiresPaymentMethod; got != want {
				t.Errorf("payment_intent.status = %q, want %q", got, want)
			}
			again := create(t, srv, "k", chargeForm(tc.amount, tc.pm))
			wantStatus(t, again, http.StatusPaymentRequired)
			if got, want := again.header.Get("Idempotent-Replayed"), "true"; got != want {
				t.Errorf("Idempotent-Replayed = %q, want %q", got, want)
			}
			if string(again.body) != string(r.body) {
				t.Errorf("replayed body differs:\n%s\nwant\n%s", again.body, r.body)
			}
			all := ledgerAll(t, b.ledger, testKey)
			if len(all) != 1 || all[0].ID != e.PaymentIntent.ID || all[0].Status != StatusRequiresPaymentMethod {
				t.Errorf("ledger = %+v, want one %s requires_payment_method", all, e.PaymentIntent.ID)
			}
		})
	}
}

func TestDeclineOverAllowsLimit(t *testing.T) {
	srv, _ := setup(t, Config{DeclineOver: 1000})
	wantStatus(t, create(t, srv, "k", chargeForm(1000, "pm_card_visa")), http.StatusOK)
}

func TestInvalidParams(t *testing.T) {
	srv, b := setup(t, Config{})
	for _, tc := range []struct {
		name  string
		edit  func(url.Values)
		param string
	}{
		{"no amount", func(v url.Values) { v.Del("amount") }, "amount"},
		{"amount not a number", func(v url.Values) { v.Set("amount", "12.5") }, "amount"},
		{"amount zero", func(v url.Values) { v.Set("amount", "0") }, "amount"},
		{"no currency", func(v url.Values) { v.Del("currency") }, "currency"},
		{"bad currency", func(v url.Values) { v.Set("currency", "euro") }, "currency"},
		{"not confirmed", func(v url.Values) { v.Del("confirm") }, "confirm"},
		{"no payment method", func(v url.Values) { v.Del("payment_method") }, "payment_method"},
		{"unknown payment method", func(v url.Values) { v.Set("payment_method", "pm_nope") }, "payment_method"},
		{"metadata key too long", func(v url.Values) { v.Set("metadata["+strings.Repeat("k", 41)+"]", "v") }, "metadata[" + strings.Repeat("k", 41) + "]"},
		{"metadata value too long", func(v url.Values) { v.Set("metadata[k]", strings.Repeat("v", 501)) }, "metadata[k]"},
		{"metadata value with NUL", func(v url.Values) { v.Set("metadata[k]", "a\x00b") }, "metadata[k]"},
		{"metadata key with NUL", func(v url.Values) { v.Set("metadata[k\x00]", "v") }, "metadata[k\x00]"},
		{"metadata value not UTF-8", func(v url.Values) { v.Set("metadata[k]", "\xff") }, "metadata[k]"},
		{"description with NUL", func(v url.Values) { v.Set("description", "\x00") }, "description"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := chargeForm(500, "pm_card_visa")
			tc.edit(f)
			key := "key-" + strings.ReplaceAll(tc.name, " ", "-")
			r := create(t, srv, key, f)
			wantStatus(t, r, http.StatusBadRequest)
			e := decodeErr(t, r.body)
			if e.Type != "invalid_request_error" || e.Param != tc.param {
				t.Errorf("error = %s param %q, want invalid_request_error param %q", e.Type, e.Param, tc.param)
			}
			// Nothing happened, so the key is free for the corrected request.
			wantStatus(t, create(t, srv, key, chargeForm(500, "pm_card_visa")), http.StatusOK)
		})
	}
	if got, want := b.ledger.Len(), 14; got != want {
		t.Errorf("ledger holds %d, want %d", got, want)
	}
}

func TestIgnoresOtherParams(t *testing.T) {
	srv, _ := setup(t, Config{})
	f := chargeForm(500, "pm_card_visa")
	f.Add("expand[]", "latest_charge")
	f.Add("automatic_payment_methods[enabled]", "true")
	f.Add("description", "two books")
	r := create(t, srv, "k", f)
	wantStatus(t, r, http.StatusOK)
	if pi := decodePI(t, r.body); pi.Description == nil || *pi.Description != "two books" {
		t.Errorf("description = %v, want two books", pi.Description)
	}
}

func TestInvalidIdempotencyKey(t *testing.T) {
	srv, b := setup(t, Config{})
	r := create(t, srv, strings.Repeat("k", 256), chargeForm(500, "pm_card_visa"))
	wantStatus(t, r, http.StatusBadRequest)
	if got, want := decodeErr(t, r.body).Type, "invalid_request_error"; got != want {
		t.Errorf("error type = %q, want %q", got, want)
	}
	if got := b.ledger.Len(); got != 0 {
		t.Errorf("ledger holds %d, want 0", got)
	}
}

func TestWithoutIdempotencyKey(t *testing.T) {
	srv, b := setup(t, Config{})
	for range 2 {
		wantStatus(t, create(t, srv, "", chargeForm(500, "pm_card_visa")), http.StatusOK)
	}
	if got, want := b.ledger.Len(), 2; got != want {
		t.Errorf("ledger holds %d, want %d: a request without a key is not idempotent", got, want)
	}
}

func TestAuth(t *testing.T) {
	for _, tc := range []struct {
		name       string
		configured string
		header     string
		want       int
	}{
		{"no header", "", "", http.StatusUnauthorized},
		{"any test key", "", "Bearer sk_test_whatever", http.StatusOK},
		{"live key", "", "Bearer sk_live_whatever", http.StatusUnauthorized},
		{"bare prefix", "", "Bearer sk_test_", http.StatusUnauthorized},
		{"other scheme", "", "Token sk_test_whatever", http.StatusUnauthorized},
		{"configured key", "sk_test_one", "Bearer sk_test_one", http.StatusOK},
		{"other key when configured", "sk_test_one", "Bearer sk_test_two", http.StatusUnauthorized},
		{"basic auth", "sk_test_one", "Basic " + basic("sk_test_one"), http.StatusOK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, _ := setup(t, Config{APIKey: tc.configured})
			for _, path := range []string{"/v1/payment_intents", "/v1/nowhere"} {
				req, _ := http.NewRequest(http.MethodGet, srv.URL+path, nil)
				if tc.header != "" {
					req.Header.Set("Authorization", tc.header)
				}
				resp, err := srv.Client().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				want := tc.want
				if want == http.StatusOK && path == "/v1/nowhere" {
					want = http.StatusNotFound
				}
				if resp.StatusCode != want {
					t.Fatalf("GET %s: status = %d, want %d; body %s", path, resp.StatusCode, want, body)
				}
				if want == http.StatusUnauthorized {
					if got := decodeErr(t, body).Type; got != "invalid_request_error" {
						t.Errorf("error type = %q, want invalid_request_error", got)
					}
					if strings.Contains(string(body), "sk_test_two") {
						t.Errorf("error body echoes the key: %s", body)
					}
				}
			}
		})
	}
}

func basic(user string) string {
	req, _ := http.NewRequest(http.MethodGet, "/", nil)
	req.SetBasicAuth(user, "")
	return strings.TrimPrefix(req.Header.Get("Authorization"), "Basic ")
}

func TestUnknownRoutes(t *testing.T) {
	srv, _ := setup(t, Config{})
	for _, tc := range []struct{ method, path string }{
		{http.MethodGet, "/"},
		{http.MethodGet, "/v1/charges"},
		{http.MethodDelete, "/v1/payment_intents"},
		{http.MethodPost, "/v1/payment_intents/pi_123"},
		{http.MethodGet, "/v1/payment_intents/"},
		{http.MethodGet, "/v1/payment_intents/pi_1/confirm"},
	} {
		r := do(t, srv.Client(), tc.method, srv.URL+tc.path, testKey, "", "")
		if r.status != http.StatusNotFound {
			t.Errorf("%s %s: status = %d, want 404", tc.method, tc.path, r.status)
			continue
		}
		if e := decodeErr(t, r.body); e.Type != "invalid_request_error" || !strings.Contains(e.Message, "Unrecognized request URL") {
			t.Errorf("%s %s: error = %+v", tc.method, tc.path, e)
		}
	}
}

func TestGetMissing(t *testing.T) {
	srv, _ := setup(t, Config{})
	r := do(t, srv.Client(), http.MethodGet, srv.URL+"/v1/payment_intents/pi_nope", testKey, "", "")
	wantStatus(t, r, http.StatusNotFound)
	if got, want := decodeErr(t, r.body).Code, "resource_missing"; got != want {
		t.Errorf("code = %q, want %q", got, want)
	}
}

func TestListPagination(t *testing.T) {
	forEachBackend(t, testListPagination)
}

func testListPagination(t *testing.T, be testBackend) {
	db := be.open(t, nil)
	srv, _ := setup(t, Config{Store: db.store, Ledger: db.ledger})
	var ids []string // oldest first
	for i := range 25 {
		r := create(t, srv, fmt.Sprintf("k%d", i), chargeForm(int64(100+i), "pm_card_visa"))
		wantStatus(t, r, http.StatusOK)
		ids = append(ids, decodePI(t, r.body).ID)
	}
	list := func(query string) listObject {
		t.Helper()
		r := do(t, srv.Client(), http.MethodGet, srv.URL+"/v1/payment_intents"+query, testKey, "", "")
		wantStatus(t, r, http.StatusOK)
		var l listObject
		if err := json.Unmarshal(r.body, &l); err != nil {
			t.Fatal(err)
		}
		if l.Object != "list" || l.URL != "/v1/payment_intents" {
			t.Errorf("list envelope = %q %q", l.Object, l.URL)
		}
		return l
	}
	def := list("")
	if got, want := len(def.Data), DefaultListLimit; got != want {
		t.Fatalf("default page has %d, want %d", got, want)
	}
	var got []string
	after := ""
	for page := 0; ; page++ {
		q := "?limit=10"
		if after != "" {
			q += "&starting_after=" + after
		}
		l := list(q)
		for _, pi := range l.Data {
			got = append(got, pi.ID)
		}
		if wantMore := page < 2; l.HasMore != wantMore {
			t.Errorf("page %d: has_more = %v, want %v", page, l.HasMore, wantMore)
		}
		if !l.HasMore {
			break
		}
		after = l.Data[len(l.Data)-1].ID
	}
	if len(got) != len(ids) {
		t.Fatalf("listed %d, want %d", len(got), len(ids))
	}
	for i, id := range got {
		if want := ids[len(ids)-1-i]; id != want {
			t.Fatalf("item %d = %s, want %s (newest first)", i, id, want)
		}
	}

	// ending_before pages back toward newer ones.
	eb := list("?limit=3&ending_before=" + ids[10])
	if len(eb.Data) != 3 || eb.Data[0].ID != ids[13] || eb.Data[2].ID != ids[11] || !eb.HasMore {
		t.Errorf("ending_before page = %v has_more %v, want %s..%s has_more", idsOf(eb.Data), eb.HasMore, ids[13], ids[11])
	}

	for _, q := range []string{"?limit=0", "?limit=101", "?limit=x", "?starting_after=pi_nope", "?starting_after=" + ids[0] + "&ending_before=" + ids[1]} {
		r := do(t, srv.Client(), http.MethodGet, srv.URL+"/v1/payment_intents"+q, testKey, "", "")
		if r.status != http.StatusBadRequest {
			t.Errorf("GET %s: status = %d, want 400", q, r.status)
		}
	}
	if l := list("?limit=100"); len(l.Data) != 25 || l.HasMore {
		t.Errorf("limit=100: %d items, has_more %v; want 25, false", len(l.Data), l.HasMore)
	}
}

func idsOf(pis []*PaymentIntent) []string {
	var ids []string
	for _, pi := range pis {
		ids = append(ids, pi.ID)
	}
	return ids
}

func TestConcurrentSameKey(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		db := be.open(t, nil)
		srv, b := setup(t, Config{Store: db.store, Ledger: db.ledger, Latency: 50 * time.Millisecond, LockWait: 10 * time.Second})
		const n = 50
		results := make([]result, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range n {
			wg.Go(func() {
				<-start
				results[i], errs[i] = post(srv, testKey, "same-key", chargeForm(999, "pm_card_visa"))
			})
		}
		close(start)
		wg.Wait()
		var id string
		fresh := 0
		for i, r := range results {
			if errs[i] != nil {
				t.Fatalf("request %d: %v", i, errs[i])
			}
			wantStatus(t, r, http.StatusOK)
			pi := decodePI(t, r.body)
			if id == "" {
				id = pi.ID
			}
			if pi.ID != id {
				t.Errorf("response %d: id %s, want %s", i, pi.ID, id)
			}
			if r.header.Get("Idempotent-Replayed") != "true" {
				fresh++
			}
		}
		if fresh != 1 {
			t.Errorf("%d responses were not replays, want 1", fresh)
		}
		if got, want := db.count(t), 1; got != want {
			t.Errorf("ledger holds %d, want %d", got, want)
		}
		if got, want := b.metrics.Executions.Load(), int64(1); got != want {
			t.Errorf("handler ran %d times, want %d", got, want)
		}
	})
}

func TestLockTimeout(t *testing.T) {
	srv, b := setup(t, Config{Latency: 500 * time.Millisecond, LockWait: 20 * time.Millisecond})
	type answer struct {
		r   result
		err error
	}
	done := make(chan answer, 1)
	go func() {
		r, err := post(srv, testKey, "k", chargeForm(500, "pm_card_visa"))
		done <- answer{r, err}
	}()
	testwait.Until(t, 0, "the first request to be charging", func() bool { return b.metrics.Executions.Load() > 0 })
	r := create(t, srv, "k", chargeForm(500, "pm_card_visa"))
	wantStatus(t, r, http.StatusTooManyRequests)
	if e := decodeErr(t, r.body); e.Type != "invalid_request_error" || e.Code != "lock_timeout" {
		t.Errorf("error = %s/%s, want invalid_request_error/lock_timeout", e.Type, e.Code)
	}
	if got, want := r.header.Get("Stripe-Should-Retry"), "true"; got != want {
		t.Errorf("Stripe-Should-Retry = %q, want %q", got, want)
	}
	first := <-done
	if first.err != nil {
		t.Fatal(first.err)
	}
	wantStatus(t, first.r, http.StatusOK)
	// Once the first is done, the repeat replays it.
	again := create(t, srv, "k", chargeForm(500, "pm_card_visa"))
	wantStatus(t, again, http.StatusOK)
	if again.header.Get("Idempotent-Replayed") != "true" {
		t.Error("repeat after completion was not replayed")
	}
}

func TestFailAfterChargeDropsConnection(t *testing.T) {
	srv, b := setup(t, Config{FailAfterCharge: 1})
	// A fresh connection each time, so that net/http does not retry the
	// dropped request on its own.
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/payment_intents", strings.NewReader(chargeForm(500, "pm_card_visa").Encode()))
	req.Header.Set("Authorization", "Bearer "+testKey)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Idempotency-Key", "k")
	resp, err := c.Do(req)
	if err == nil {
		resp.Body.Close()
		t.Fatalf("got status %d, want the connection dropped", resp.StatusCode)
	}
	all := ledgerAll(t, b.ledger, testKey)
	if len(all) != 1 {
		t.Fatalf("ledger holds %d, want 1: the charge is made before the connection drops", len(all))
	}
	// The retry is a replay: never dropped, never a second charge.
	r := do(t, c, http.MethodPost, srv.URL+"/v1/payment_intents", testKey, "k", chargeForm(500, "pm_card_visa").Encode())
	wantStatus(t, r, http.StatusOK)
	if got := decodePI(t, r.body).ID; got != all[0].ID {
		t.Errorf("retry answered %s, want %s", got, all[0].ID)
	}
	if r.header.Get("Idempotent-Replayed") != "true" {
		t.Error("retry was not a replay")
	}
	// A request without a key is never dropped.
	wantStatus(t, do(t, c, http.MethodPost, srv.URL+"/v1/payment_intents", testKey, "", chargeForm(500, "pm_card_visa").Encode()), http.StatusOK)
	if got, want := b.gw.dropped.Load(), int64(1); got != want {
		t.Errorf("dropped %d, want %d", got, want)
	}
}

// failingStore is an idem.Store whose Claim fails.
type failingStore struct{ idem.Store }

func (failingStore) Claim(context.Context, idemdriver.ClaimParams) (idemdriver.Claim, error) {
	return idemdriver.Claim{}, errors.New("disk on fire")
}

func TestStoreUnavailable(t *testing.T) {
	srv, b := setup(t, Config{Store: failingStore{}})
	r := create(t, srv, "k", chargeForm(500, "pm_card_visa"))
	wantStatus(t, r, http.StatusInternalServerError)
	if got, want := decodeErr(t, r.body).Type, "api_error"; got != want {
		t.Errorf("error type = %q, want %q", got, want)
	}
	if got := b.ledger.Len(); got != 0 {
		t.Errorf("ledger holds %d, want 0", got)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []Config{{FailAfterCharge: -0.1}, {FailAfterCharge: 1.5}, {DeclineOver: -1}, {Latency: -time.Second}} {
		if err := c.Validate(); err == nil {
			t.Errorf("Validate(%+v) = nil, want an error", c)
		}
	}
	if err := (Config{FailAfterCharge: 1, DeclineOver: 5, Latency: time.Second}).Validate(); err != nil {
		t.Errorf("Validate of a valid Config = %v", err)
	}
}
