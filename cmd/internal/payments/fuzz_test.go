package payments

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idem-go/idem"
)

// Fuzz tests of the gateway's form decoding (issue 10, point 5): a raw
// query and form body go through the real handler, the memory ledger
// behind it, and whatever they hold the answer is never a panic nor a 5xx;
// a 200 is within the documented limits, and what it charged or refunded is
// what the request said; every other answer is a Stripe error object.
// `go test` runs the seeds; `go test -run=^$ -fuzz=FuzzCreateIntentForm
// ./cmd/internal/payments` (or FuzzRefundForm) searches further.

// fuzzGateway returns a gateway on the memory ledger, as setup builds it,
// to be called in process: a fuzz target runs many inputs on one.
func fuzzGateway() (*Server, *MemLedger) {
	l := NewMemLedger()
	return NewServer(Config{Ledger: l, Metrics: new(idem.Metrics), Logger: slog.New(slog.DiscardHandler)}), l
}

// fuzzKeys numbers the Idempotency-Keys of fuzzed requests, so that no two
// inputs share one.
var fuzzKeys atomic.Int64

// fuzzPost sends a POST with the raw query and body to gw's handler. It
// reports false for a query that no HTTP server would deliver as it is
// (a request line holds no space, control byte or '#').
func fuzzPost(t *testing.T, gw *Server, path, query, body string, keyed bool) (*httptest.ResponseRecorder, bool) {
	t.Helper()
	if strings.ContainsFunc(query, func(r rune) bool { return r <= ' ' || r >= 0x7f || r == '#' }) {
		return nil, false
	}
	req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
	req.URL.RawQuery = query
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Authorization", "Bearer "+testKey)
	if keyed {
		req.Header.Set("Idempotency-Key", fmt.Sprintf("fuzz-%d", fuzzKeys.Add(1)))
	}
	rec := httptest.NewRecorder()
	gw.ServeHTTP(rec, req)
	return rec, true
}

// fuzzForm is what a request's parameters are, read independently of the
// gateway: the query's and the body's, or nil when either is not a form.
func fuzzForm(query, body string) url.Values {
	q, err := url.ParseQuery(query)
	if err != nil {
		return nil
	}
	b, err := url.ParseQuery(body)
	if err != nil {
		return nil
	}
	for k, vs := range b {
		q[k] = append(q[k], vs...)
	}
	return q
}

// checkStripeAnswer fails on a 5xx, and on an answer other than a 200
// that is not a Stripe error object ({"error": {"type", "message"}}), or
// that is a 400 about a parameter (code parameter_…) and names none
// although v, the request's parameters (nil: unknown), has no parameter
// with an empty name. It returns the error object of such an answer.
func checkStripeAnswer(t *testing.T, rec *httptest.ResponseRecorder, v url.Values) *PaymentError {
	t.Helper()
	if rec.Code >= 500 {
		t.Fatalf("status %d, want no 5xx: %s", rec.Code, rec.Body)
	}
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Fatalf("status %d: Content-Type %q, want application/json", rec.Code, ct)
	}
	if !json.Valid(rec.Body.Bytes()) {
		t.Fatalf("status %d: the body is not JSON: %q", rec.Code, rec.Body)
	}
	if rec.Code == http.StatusOK {
		return nil
	}
	var e struct {
		Error *PaymentError `json:"error"`
	}
	dec := json.NewDecoder(bytes.NewReader(rec.Body.Bytes()))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil || e.Error == nil || e.Error.Type == "" || e.Error.Message == "" {
		t.Fatalf("status %d: not a Stripe error object (%v): %s", rec.Code, err, rec.Body)
	}
	if rec.Code == http.StatusBadRequest {
		switch e.Error.Type {
		case "invalid_request_error", "idempotency_error":
		default:
			t.Fatalf("400 of type %q: %s", e.Error.Type, rec.Body)
		}
		if _, empty := v[""]; strings.HasPrefix(e.Error.Code, "parameter_") && e.Error.Param == "" && v != nil && !empty {
			t.Fatalf("400 %s names no param: %s", e.Error.Code, rec.Body)
		}
	}
	return e.Error
}

// checkIntent checks a PaymentIntent the gateway answered for the
// parameters v (nil: unknown).
func checkIntent(t *testing.T, pi *PaymentIntent, v url.Values) {
	t.Helper()
	if pi == nil {
		t.Fatal("no PaymentIntent")
	}
	if pi.Amount < MinAmount || pi.Amount > MaxAmount {
		t.Fatalf("amount %d, want %d..%d", pi.Amount, MinAmount, MaxAmount)
	}
	if !IsCurrency(pi.Currency) || pi.Currency != strings.ToLower(pi.Currency) {
		t.Fatalf("currency %q, want an ISO 4217 code in lower case", pi.Currency)
	}
	if v == nil {
		return
	}
	if a := v["amount"]; len(a) != 1 || !sameInteger(a[0], pi.Amount) {
		t.Fatalf("charged %d for amount %q", pi.Amount, a)
	}
	if c := v["currency"]; len(c) != 1 || strings.ToLower(c[0]) != pi.Currency {
		t.Fatalf("charged in %q for currency %q", pi.Currency, c)
	}
	if pm := v["payment_method"]; len(pm) != 1 || pm[0] != pi.PaymentMethod {
		t.Fatalf("payment_method %q for %q", pi.PaymentMethod, pm)
	}
}

// sameInteger reports whether s is n in decimal (a sign and leading zeros
// allowed, as strconv.ParseInt takes them).
func sameInteger(s string, n int64) bool {
	m, err := strconv.ParseInt(s, 10, 64)
	return err == nil && m == n
}

func FuzzCreateIntentForm(f *testing.F) {
	valid := chargeForm(1000, "pm_card_visa").Encode()
	for _, s := range []struct {
		query, body string
		keyed       bool
	}{
		{"", valid, true},
		{"", valid, false},
		{"", "amount=1&currency=JPY&confirm=true&payment_method=pm_card_amex", true},
		{"", "amount=99999999&currency=xcg&confirm=true&payment_method=pm_card_mastercard&description=%C3%A9&metadata=", true},
		{"amount=500", "currency=eur&confirm=true&payment_method=pm_card_visa", true},
		{"amount=500", valid, true}, // amount twice
		{"", "amount=100000000&currency=eur&confirm=true&payment_method=pm_card_visa", true},
		{"", "amount=0&currency=eur&confirm=true&payment_method=pm_card_visa", true},
		{"", "amount=-1&currency=eur&confirm=true&payment_method=pm_card_visa", true},
		{"", "amount=%2B12&currency=eur&confirm=true&payment_method=pm_card_visa", true},
		{"", "amount=99999999999999999999&currency=eur&confirm=true&payment_method=pm_card_visa", true},
		{"", "amount=12&currency=xxx&confirm=true&payment_method=pm_card_visa", true},
		{"", "amount=12&currency=eu%00&confirm=true&payment_method=pm_card_visa", true},
		{"", "amount=12&currency=eur&confirm=false&payment_method=pm_card_visa", true},
		{"", "amount=12&currency=eur&confirm=true&payment_method=pm_card_chargeDeclined", true},
		{"", "amount=12&currency=eur&confirm=true&payment_method=pm_card_chargeDeclinedInsufficientFunds", false},
		{"", "amount=12&currency=eur&confirm=true&payment_method=pm_nope", true},
		{"", "amount=12&currency=eur&confirm=true&payment_method=pm_card_visa&metadata[a][b]=c", true},
		{"", "amount=12&currency=eur&confirm=true&payment_method=pm_card_visa&metadata[%FF]=c", true},
		{"", "amount=12&currency=eur&confirm=true&payment_method=pm_card_visa&metadata=x", true},
		{"", "amount=12&currency=eur&confirm=true&payment_method=pm_card_visa&expand[]=a&expand[7]=b", true},
		{"", "amount=12&currency=eur&confirm=true&payment_method=pm_card_visa&automatic_payment_methods[enabled]=true&automatic_payment_methods[allow_redirects]=never", true},
		{"", "amount=12&currency=eur&confirm=true&payment_method=pm_card_visa&description=%00", true},
		{"", "amount=12&currency=eur&confirm=true&payment_method=pm_card_visa&unknown=1", true},
		{"", "amount=12;currency=eur", true},
		{"", "%zz", true},
		{"%zz", valid, true},
		{"", "", true},
		{"", "\xff\xfe", false},
		// Found by the fuzzer: a parameter with an empty name is refused
		// as unknown, and the error can name no param.
		{"ax", "amount=1&confirm=true&currency=eur&=0&payment_method=pm_card_visa", true},
	} {
		f.Add(s.query, s.body, s.keyed)
	}
	gw, ledger := fuzzGateway()
	f.Fuzz(func(t *testing.T, query, body string, keyed bool) {
		rec, ok := fuzzPost(t, gw, "/v1/payment_intents", query, body, keyed)
		if !ok {
			t.Skip("a query no server delivers")
		}
		v := fuzzForm(query, body)
		perr := checkStripeAnswer(t, rec, v)
		switch rec.Code {
		case http.StatusOK:
			if v == nil {
				t.Fatalf("200 for a request that is not a form: %q %q", query, body)
			}
			var pi PaymentIntent
			if err := json.Unmarshal(rec.Body.Bytes(), &pi); err != nil {
				t.Fatal(err)
			}
			checkIntent(t, &pi, v)
			if pi.Status != StatusSucceeded || pi.AmountReceived != pi.Amount {
				t.Fatalf("200 with status %q, received %d of %d", pi.Status, pi.AmountReceived, pi.Amount)
			}
			kept, err := ledger.Get(context.Background(), AccountFor(testKey), pi.ID)
			if err != nil {
				t.Fatalf("the ledger has no %s: %v", pi.ID, err)
			}
			if kept.Amount != pi.Amount || kept.Currency != pi.Currency {
				t.Fatalf("the ledger keeps %d %s, the answer says %d %s", kept.Amount, kept.Currency, pi.Amount, pi.Currency)
			}
		case http.StatusPaymentRequired:
			if perr.Type != "card_error" {
				t.Fatalf("402 of type %q", perr.Type)
			}
			checkIntent(t, perr.PaymentIntent, v)
		case http.StatusBadRequest, http.StatusNotFound, http.StatusRequestEntityTooLarge:
		default:
			t.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
	})
}

// fuzzPI is the placeholder that FuzzRefundForm replaces, in the query and
// the body, with the ID of a PaymentIntent made for the input.
const fuzzPI = "{pi}"

func FuzzRefundForm(f *testing.F) {
	for _, s := range []struct {
		query, body string
		keyed       bool
		amount      uint32
		currency    uint16
	}{
		{"", "payment_intent={pi}", true, 1000, 0},
		{"", "payment_intent={pi}", false, 99_999_999, 7},
		{"", "payment_intent={pi}&amount=300", true, 1000, 1},
		{"", "payment_intent={pi}&amount=1000", true, 1000, 2},
		{"", "payment_intent={pi}&amount=1001", true, 1000, 3},
		{"", "payment_intent={pi}&amount=0", true, 1000, 4},
		{"", "payment_intent={pi}&amount=-3", true, 1000, 5},
		{"", "payment_intent={pi}&amount=100000000", true, 1000, 6},
		{"", "payment_intent={pi}&amount=9223372036854775808", true, 1000, 8},
		{"amount=5", "payment_intent={pi}", true, 1000, 9},
		{"payment_intent={pi}", "payment_intent={pi}", true, 1000, 9},
		{"", "payment_intent={pi}&reason=duplicate&metadata[why]=x&expand[]=charge", true, 1000, 10},
		{"", "payment_intent={pi}&reason=because", true, 1000, 11},
		{"", "payment_intent={pi}&metadata[%00]=x", true, 1000, 12},
		{"", "payment_intent=pi_missing", true, 1000, 13},
		{"", "payment_intent=", true, 1000, 14},
		{"", "payment_intent=%C0", true, 1000, 15},
		{"", "amount=5", true, 1000, 16},
		{"", "payment_intent={pi}&charge=ch_1", true, 1000, 17},
		{"", "payment_intent={pi};amount=5", true, 1000, 18},
		{"", "%", false, 1000, 19},
		{"", "", true, 1000, 20},
		{"", "payment_intent=0000&=", true, 943, 6}, // found by the fuzzer: an empty name
	} {
		f.Add(s.query, s.body, s.keyed, s.amount, s.currency)
	}
	gw, ledger := fuzzGateway()
	account := AccountFor(testKey)
	f.Fuzz(func(t *testing.T, query, body string, keyed bool, amount uint32, currency uint16) {
		ctx := context.Background()
		pi := &PaymentIntent{
			ID:                 newID("pi_", 24),
			Object:             "payment_intent",
			Amount:             int64(amount)%MaxAmount + 1,
			CaptureMethod:      "automatic",
			ConfirmationMethod: "automatic",
			Currency:           Currencies[int(currency)%len(Currencies)],
			PaymentMethod:      "pm_card_visa",
			PaymentMethodTypes: []string{"card"},
			Status:             StatusSucceeded,
			Account:            account,
		}
		pi.AmountReceived = pi.Amount
		if err := ledger.Create(ctx, pi); err != nil {
			t.Fatal(err)
		}
		query = strings.ReplaceAll(query, fuzzPI, pi.ID)
		body = strings.ReplaceAll(body, fuzzPI, pi.ID)
		rec, ok := fuzzPost(t, gw, "/v1/refunds", query, body, keyed)
		if !ok {
			t.Skip("a query no server delivers")
		}
		v := fuzzForm(query, body)
		checkStripeAnswer(t, rec, v)
		kept, err := ledger.Get(ctx, account, pi.ID)
		if err != nil {
			t.Fatal(err)
		}
		if kept.AmountRefunded < 0 || kept.AmountRefunded > kept.AmountReceived {
			t.Fatalf("%s refunded %d of %d", pi.ID, kept.AmountRefunded, kept.AmountReceived)
		}
		switch rec.Code {
		case http.StatusOK:
			if v == nil {
				t.Fatalf("200 for a request that is not a form: %q %q", query, body)
			}
			var rf RefundRecord
			if err := json.Unmarshal(rec.Body.Bytes(), &rf); err != nil {
				t.Fatal(err)
			}
			if rf.Amount < MinAmount || rf.Amount > MaxAmount {
				t.Fatalf("refund amount %d, want %d..%d", rf.Amount, MinAmount, MaxAmount)
			}
			if !IsCurrency(rf.Currency) || rf.Currency != strings.ToLower(rf.Currency) {
				t.Fatalf("refund currency %q, want an ISO 4217 code in lower case", rf.Currency)
			}
			if p := v["payment_intent"]; len(p) != 1 || p[0] != rf.PaymentIntent {
				t.Fatalf("refunded %s for payment_intent %q", rf.PaymentIntent, p)
			}
			if rf.PaymentIntent != pi.ID {
				return // another input's PaymentIntent, named in full by the fuzzer
			}
			if rf.Currency != pi.Currency {
				t.Fatalf("refund in %q of a PaymentIntent in %q", rf.Currency, pi.Currency)
			}
			want := pi.Amount
			if a, ok := v["amount"]; ok {
				if len(a) != 1 || !sameInteger(a[0], rf.Amount) {
					t.Fatalf("refunded %d for amount %q", rf.Amount, a)
				}
				want = rf.Amount
			}
			if rf.Amount != want || kept.AmountRefunded != want {
				t.Fatalf("refunded %d (ledger: %d) of %d, want %d", rf.Amount, kept.AmountRefunded, pi.Amount, want)
			}
		case http.StatusBadRequest, http.StatusNotFound, http.StatusRequestEntityTooLarge:
			if kept.AmountRefunded != 0 {
				t.Fatalf("status %d, yet %s refunded %d", rec.Code, pi.ID, kept.AmountRefunded)
			}
		default:
			t.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
	})
}
