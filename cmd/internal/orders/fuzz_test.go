package orders

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/golang-jwt/jwt/v5"
	"github.com/idem-go/idem"
	"github.com/idem-go/idem/sqlitestore"
)

// Fuzz tests of the order service's input checks (issue 10, point 5): the
// body of POST /v1/orders, through decodeCreate and through the real
// handler on SQLite with the fake gateway, and the bearer token check.
// Whatever the input, no panic and no 5xx; an order that is made is within
// every bound of the contract and is what the client sent; a token is
// accepted only when it is valid. `go test` runs the seeds; `go test
// -run=^$ -fuzz=FuzzCreateOrderBody ./cmd/internal/orders` (or FuzzDecodeCreate,
// FuzzAuthorization) searches further.

// fuzzService is the order API as setup builds it (SQLite, sqlitestore,
// the fake gateway, a fixed clock), to be called in process: a fuzz target
// runs many inputs on one.
type fuzzService struct {
	*testBundle
	h http.Handler
}

func newFuzzService(f *testing.F) *fuzzService {
	f.Helper()
	ctx := context.Background()
	b := newBundle()
	st, err := sqlitestore.Open(ctx, filepath.Join(f.TempDir(), "orders.db"), sqlitestore.Options{Now: b.clock.Now})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { st.Close() })
	if err := MigrateSQLite(ctx, st.DB()); err != nil {
		f.Fatal(err)
	}
	b.store = st
	b.repo = NewSQLiteRepository(st.DB(), sqlitestore.FromContext)
	h := NewHandler(Config{
		Repo:        b.repo,
		Payer:       b.payer,
		Idem:        st,
		IdemOptions: idem.Options{Metrics: b.idemM},
		Secret:      b.secret,
		Now:         b.clock.Now,
		Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
		Metrics:     b.metrics,
	})
	return &fuzzService{testBundle: b, h: h}
}

// serve runs one request through the handler; any header value goes
// as it is.
func (s *fuzzService) serve(method, target, body string, header map[string]string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, target, strings.NewReader(body))
	for k, v := range header {
		req.Header[k] = []string{v}
	}
	rec := httptest.NewRecorder()
	s.h.ServeHTTP(rec, req)
	return rec
}

// checkProblem fails on a 5xx and on an error answer that is not
// application/problem+json with its status.
func checkProblem(t *testing.T, rec *httptest.ResponseRecorder) {
	t.Helper()
	if rec.Code >= 500 {
		t.Fatalf("status %d, want no 5xx: %s", rec.Code, rec.Body)
	}
	if rec.Code < 400 {
		return
	}
	if ct := rec.Header().Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("status %d: Content-Type %q, want application/problem+json", rec.Code, ct)
	}
	var p struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &p); err != nil || p.Type == "" || p.Title == "" || p.Status != rec.Code {
		t.Fatalf("status %d: not a problem of that status (%v): %s", rec.Code, err, rec.Body)
	}
}

// checkOrderBounds fails unless items and currency are within every bound
// of the contract, and total is their total.
func checkOrderBounds(t *testing.T, items []Item, currency string, total int64) {
	t.Helper()
	if len(items) < 1 || len(items) > MaxItems {
		t.Fatalf("%d items, want 1..%d", len(items), MaxItems)
	}
	var sum int64
	for i, it := range items {
		n := utf8.RuneCountInString(it.SKU)
		if !utf8.ValidString(it.SKU) || n < 1 || n > MaxSKU || strings.IndexFunc(it.SKU, unicode.IsControl) >= 0 || strings.TrimSpace(it.SKU) == "" {
			t.Fatalf("items[%d].sku %q: want 1..%d characters of UTF-8, not blank, no control character", i, it.SKU, MaxSKU)
		}
		if it.Quantity < 1 || it.Quantity > MaxQuantity {
			t.Fatalf("items[%d].quantity %d, want 1..%d", i, it.Quantity, MaxQuantity)
		}
		if it.UnitPrice < 1 || it.UnitPrice > MaxTotal {
			t.Fatalf("items[%d].unit_price %d, want 1..%d", i, it.UnitPrice, MaxTotal)
		}
		sum += it.Quantity * it.UnitPrice // each term <= 1000 * MaxTotal: no overflow over 100 items
	}
	if sum != total || total < 1 || total > MaxTotal {
		t.Fatalf("total %d (items sum to %d), want 1..%d and the sum", total, sum, MaxTotal)
	}
	if !IsCurrency(currency) {
		t.Fatalf("currency %q, want an active ISO 4217 code in capitals", currency)
	}
}

// checkAsSent fails unless items and currency are what body says, read by
// plain encoding/json: what is paid for is what the client sent.
func checkAsSent(t *testing.T, body string, items []Item, currency string) {
	t.Helper()
	var sent CreateRequest
	if err := json.Unmarshal([]byte(body), &sent); err != nil {
		t.Fatalf("accepted a body that encoding/json refuses (%v): %q", err, body)
	}
	if !reflect.DeepEqual(sent.Items, items) || sent.Currency != currency {
		t.Fatalf("accepted %+v %q for a body that says %+v %q", items, currency, sent.Items, sent.Currency)
	}
}

// orderSeeds are bodies of POST /v1/orders, valid and not.
var orderSeeds = []string{
	orderBody,
	`{"items":[{"sku":"a","quantity":1,"unit_price":1}],"currency":"JPY"}`,
	`{"items":[{"sku":"SKU-1","quantity":1000,"unit_price":99999}],"currency":"EUR"}`,
	`{"items":[{"sku":"SKU-1","quantity":1000,"unit_price":100000}],"currency":"EUR"}`,
	`{"items":[{"sku":"SKU-1","quantity":1,"unit_price":99999999}],"currency":"XCG"}`,
	`{"items":[{"sku":"SKU-1","quantity":1,"unit_price":100000000}],"currency":"EUR"}`,
	`{"items":[{"sku":"SKU-1","quantity":1,"unit_price":9223372036854775807},{"sku":"b","quantity":1000,"unit_price":9223372036854775807}],"currency":"EUR"}`,
	`{"items":[{"sku":"SKU-1","quantity":1001,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"sku":"SKU-1","quantity":0,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"sku":"SKU-1","quantity":-1,"unit_price":-1}],"currency":"EUR"}`,
	`{"items":[{"sku":"SKU-1","quantity":1.5,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"sku":"SKU-1","quantity":1e2,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"sku":"SKU-1","quantity":"1","unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"sku":"` + strings.Repeat("é", MaxSKU) + `","quantity":1,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"sku":"` + strings.Repeat("x", MaxSKU+1) + `","quantity":1,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"sku":"","quantity":1,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"sku":"   ","quantity":1,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"sku":"a\u0000b","quantity":1,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"sku":"a\u0085b","quantity":1,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"sku":"a\ud800b","quantity":1,"unit_price":1}],"currency":"EUR"}`,
	"{\"items\":[{\"sku\":\"a\xffb\",\"quantity\":1,\"unit_price\":1}],\"currency\":\"EUR\"}",
	`{"items":[{"sku":"a","quantity":1,"unit_price":1}],"currency":"eur"}`,
	`{"items":[{"sku":"a","quantity":1,"unit_price":1}],"currency":"XXX"}`,
	`{"items":[{"sku":"a","quantity":1,"unit_price":1}],"currency":"EUR","CURRENCY":"USD"}`,
	`{"items":[{"sku":"a","quantity":1,"unit_price":1}],"currency":"EUR","currency":"USD"}`,
	`{"items":[{"sku":"a","SKU":"b","quantity":1,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"\u017fku":"a","quantity":1,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[{"sku":"a","quantity":1,"unit_price":1,"note":"x"}],"currency":"EUR"}`,
	`{"items":[],"currency":"EUR"}`,
	`{"items":null,"currency":"EUR"}`,
	`{"items":[{"sku":"a","quantity":1,"unit_price":1}],"currency":"EUR"} {}`,
	`{"items":[{"sku":"a","quantity":1,"unit_price":1}],"currency":"EUR"`,
	`[]`,
	`null`,
	`"x"`,
	``,
	`{"items":[{"sku":"a","quantity":1,"unit_price":1}],"currency":"EUR","extra":{"a":[1,{"b":2,"B":3}]}}`,
	`{"items":[` + strings.Repeat(`{"sku":"a","quantity":1,"unit_price":1},`, MaxItems) + `{"sku":"a","quantity":1,"unit_price":1}],"currency":"EUR"}`,
	`{"items":[` + strings.Repeat(`{"sku":"a","quantity":1,"unit_price":1},`, MaxItems-1) + `{"sku":"a","quantity":1,"unit_price":1}],"currency":"EUR"}`,
}

func FuzzDecodeCreate(f *testing.F) {
	for _, s := range orderSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, body string) {
		req, total, err := decodeCreate(strings.NewReader(body))
		if err != nil {
			if ve := (*ValidationError)(nil); !errors.As(err, &ve) && err.Error() == "" {
				t.Fatalf("an error without a detail: %#v", err)
			}
			return
		}
		checkOrderBounds(t, req.Items, req.Currency, total)
		checkAsSent(t, body, req.Items, req.Currency)
	})
}

func FuzzCreateOrderBody(f *testing.F) {
	for _, s := range orderSeeds {
		f.Add(s)
	}
	s := newFuzzService(f)
	const user = "fuzz-user"
	tok, err := IssueToken(s.secret, user, time.Hour, s.clock.Now())
	if err != nil {
		f.Fatal(err)
	}
	var keys atomic.Int64
	f.Fuzz(func(t *testing.T, body string) {
		rec := s.serve(http.MethodPost, "/v1/orders", body, map[string]string{
			"Authorization":   "Bearer " + tok,
			"Content-Type":    "application/json",
			"Idempotency-Key": fmt.Sprintf("fuzz-%d", keys.Add(1)),
		})
		checkProblem(t, rec)
		switch rec.Code {
		case http.StatusCreated:
		case http.StatusBadRequest, http.StatusRequestEntityTooLarge:
			return
		default:
			t.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
		var o Order
		dec := json.NewDecoder(bytes.NewReader(rec.Body.Bytes()))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&o); err != nil {
			t.Fatalf("order body: %v (%s)", err, rec.Body)
		}
		checkOrderBounds(t, o.Items, o.Currency, o.Total)
		checkAsSent(t, body, o.Items, o.Currency)
		if o.UserID != user || o.Status != StatusPaid || o.PaymentID == "" {
			t.Fatalf("order %+v", o)
		}
		// What was charged is the order's total, and what was kept is
		// what was answered.
		s.payer.mu.Lock()
		var paid *PaymentRequest
		for _, p := range s.payer.payments {
			if p.req.OrderRef == o.ID {
				paid = &p.req
			}
		}
		s.payer.mu.Unlock()
		if paid == nil || paid.Amount != o.Total || paid.Currency != o.Currency {
			t.Fatalf("order %s of %d %s: payment %+v", o.ID, o.Total, o.Currency, paid)
		}
		kept, err := s.repo.Get(context.Background(), user, o.ID)
		if err != nil {
			t.Fatalf("the order %s is not kept: %v", o.ID, err)
		}
		if !reflect.DeepEqual(kept.Items, o.Items) || kept.Total != o.Total || kept.Currency != o.Currency {
			t.Fatalf("kept %+v, answered %+v", kept, o)
		}
	})
}

// acceptable reports why the Authorization header value h may not be
// accepted, or "" when it holds a valid token for now signed with secret,
// read independently of authenticate: Bearer and a JWS of three segments
// whose header's alg is HS256, whose HMAC-SHA256 under secret is its
// signature, and whose claims have an exp after now and a sub of 1..MaxUser
// bytes of UTF-8 without control characters (returned).
func acceptable(h string, secret []byte, now time.Time) (sub, why string) {
	scheme, raw, ok := strings.Cut(strings.TrimSpace(h), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", "not Bearer"
	}
	parts := strings.Split(strings.TrimSpace(raw), ".")
	if len(parts) != 3 {
		return "", "not three segments"
	}
	seg := func(s string) []byte {
		b, err := base64.RawURLEncoding.DecodeString(s)
		if err != nil {
			return nil
		}
		return b
	}
	var head struct {
		Alg any `json:"alg"`
	}
	if err := json.Unmarshal(seg(parts[0]), &head); err != nil || head.Alg != "HS256" {
		return "", "alg not HS256"
	}
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(parts[0] + "." + parts[1]))
	if sig := seg(parts[2]); sig == nil || !hmac.Equal(sig, mac.Sum(nil)) {
		return "", "not signed with the secret"
	}
	var claims struct {
		Sub *string      `json:"sub"`
		Exp *json.Number `json:"exp"`
	}
	if err := json.Unmarshal(seg(parts[1]), &claims); err != nil {
		return "", "claims not JSON"
	}
	if claims.Exp == nil {
		return "", "no exp"
	}
	if exp, err := strconv.ParseFloat(string(*claims.Exp), 64); err != nil || !(exp > float64(now.Unix())) {
		return "", "exp not in the future"
	}
	if claims.Sub == nil || *claims.Sub == "" || len(*claims.Sub) > MaxUser || !utf8.ValidString(*claims.Sub) || strings.IndexFunc(*claims.Sub, unicode.IsControl) >= 0 {
		return "", "sub not 1..255 bytes of text"
	}
	return *claims.Sub, ""
}

func FuzzAuthorization(f *testing.F) {
	s := newFuzzService(f)
	now := s.clock.Now()
	issue := func(secret []byte, user string, ttl time.Duration, at time.Time) string {
		tok, err := IssueToken(secret, user, ttl, at)
		if err != nil {
			f.Fatal(err)
		}
		return tok
	}
	sign := func(m jwt.SigningMethod, key any, claims jwt.MapClaims) string {
		tok, err := jwt.NewWithClaims(m, claims).SignedString(key)
		if err != nil {
			f.Fatal(err)
		}
		return tok
	}
	exp := now.Add(time.Hour).Unix()
	valid := issue(s.secret, "alice", time.Hour, now)
	for _, h := range []string{
		"Bearer " + valid,
		"bearer  " + valid + " ",
		"BEARER\t" + valid,
		"Bearer " + issue(s.secret, strings.Repeat("u", MaxUser), time.Hour, now),
		"Bearer " + issue(s.secret, "üser ☃", time.Minute, now),
		"Bearer " + issue(s.secret, "bob", time.Second, now.Add(-time.Second)), // exp = now
		"Bearer " + issue(s.secret, "bob", time.Hour, now.Add(-2*time.Hour)),   // expired
		"Bearer " + issue(s.secret, "bob", time.Hour, now.Add(time.Hour)),      // issued in the future
		"Bearer " + issue([]byte("another-secret-0123456789"), "bob", time.Hour, now),
		"Bearer " + valid + "=",
		"Bearer " + valid[:len(valid)-1],
		"Bearer " + valid + ".x",
		"Bearer " + sign(jwt.SigningMethodHS512, s.secret, jwt.MapClaims{"sub": "bob", "exp": exp}),
		"Bearer " + sign(jwt.SigningMethodHS384, s.secret, jwt.MapClaims{"sub": "bob", "exp": exp}),
		"Bearer " + sign(jwt.SigningMethodNone, jwt.UnsafeAllowNoneSignatureType, jwt.MapClaims{"sub": "bob", "exp": exp}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": "bob"}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": "bob", "exp": nil}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": "bob", "exp": strconv.FormatInt(exp, 10)}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": "bob", "exp": float64(exp) + 0.5}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": "bob", "exp": 1e300}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": "bob", "exp": "soon"}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": "bob", "exp": exp, "nbf": exp}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"exp": exp}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": "", "exp": exp}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": 7, "exp": exp}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": strings.Repeat("u", MaxUser+1), "exp": exp}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": "a\x00b", "exp": exp}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": "a\u0085b", "exp": exp}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": "a\x7fb", "exp": exp}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"SUB": "bob", "Exp": exp}),
		"Bearer " + sign(jwt.SigningMethodHS256, s.secret, jwt.MapClaims{"sub": "bob", "exp": exp, "aud": 5}),
		"Bearer",
		"Bearer ",
		"Basic YWxpY2U6c2VjcmV0",
		valid,
		"",
		"Bearer a.b.c",
		"Bearer ..",
		"Bearer \xff.\x00.\n",
	} {
		f.Add(h)
	}
	f.Fuzz(func(t *testing.T, h string) {
		req := httptest.NewRequest(http.MethodGet, "/v1/orders", nil)
		req.Header["Authorization"] = []string{h}
		user, detail := authenticate(req, s.secret, s.clock.Now)
		want, why := acceptable(h, s.secret, now)
		switch {
		case detail == "" && why != "":
			t.Fatalf("accepted as %q, yet %s: %q", user, why, h)
		case detail == "" && user != want:
			t.Fatalf("accepted as %q, the token's sub is %q: %q", user, want, h)
		case detail != "" && user != "":
			t.Fatalf("refused (%s) with a user %q", detail, user)
		}

		// The same through the handler: GET /v1/orders answers 200 to the
		// accepted only, 401 to the others.
		rec := s.serve(http.MethodGet, "/v1/orders", "", map[string]string{"Authorization": h})
		checkProblem(t, rec)
		switch {
		case detail == "" && rec.Code != http.StatusOK:
			t.Fatalf("accepted token, status %d: %s", rec.Code, rec.Body)
		case detail != "" && rec.Code != http.StatusUnauthorized:
			t.Fatalf("refused token (%s), status %d: %s", detail, rec.Code, rec.Body)
		case detail != "" && !strings.HasPrefix(rec.Header().Get("WWW-Authenticate"), "Bearer "):
			t.Fatalf("401 without a Bearer challenge: %q", rec.Header().Get("WWW-Authenticate"))
		}
	})
}
