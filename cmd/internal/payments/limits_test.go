package payments

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
)

// TestParamLimits: each parameter of POST /v1/payment_intents at its
// limit is accepted, and beyond it refused with 400, the code and the
// param, before anything is charged.
func TestParamLimits(t *testing.T) {
	srv, b := setup(t, Config{})
	metadata := func(n int) func(url.Values) {
		return func(v url.Values) {
			v.Del("metadata[order_ref]")
			for i := range n {
				v.Set(fmt.Sprintf("metadata[k%02d]", i), "v")
			}
		}
	}
	for _, tc := range []struct {
		name        string
		edit        func(url.Values)
		code, param string // code "" means accepted
	}{
		{"amount at minimum", func(v url.Values) { v.Set("amount", "1") }, "", ""},
		{"amount at maximum", func(v url.Values) { v.Set("amount", "99999999") }, "", ""},
		{"amount over maximum", func(v url.Values) { v.Set("amount", "100000000") }, "parameter_invalid_integer", "amount"},
		{"amount overflows", func(v url.Values) { v.Set("amount", "99999999999999999999") }, "parameter_invalid_integer", "amount"},
		{"amount negative", func(v url.Values) { v.Set("amount", "-5") }, "parameter_invalid_integer", "amount"},
		{"amount twice", func(v url.Values) { v.Add("amount", "500") }, "parameter_invalid_integer", "amount"},
		{"currency upper case", func(v url.Values) { v.Set("currency", "JPY") }, "", ""},
		{"currency new code", func(v url.Values) { v.Set("currency", "xcg") }, "", ""},
		{"currency three letters not ISO", func(v url.Values) { v.Set("currency", "abc") }, "parameter_invalid_string", "currency"},
		{"currency no money", func(v url.Values) { v.Set("currency", "xxx") }, "parameter_invalid_string", "currency"},
		{"currency withdrawn", func(v url.Values) { v.Set("currency", "hrk") }, "parameter_invalid_string", "currency"},
		{"currency long", func(v url.Values) { v.Set("currency", strings.Repeat("e", 300)) }, "parameter_invalid_string", "currency"},
		{"description at maximum", func(v url.Values) { v.Set("description", strings.Repeat("é", 1000)) }, "", ""},
		{"description over maximum", func(v url.Values) { v.Set("description", strings.Repeat("a", 1001)) }, "parameter_invalid_string", "description"},
		{"description twice", func(v url.Values) { v.Add("description", "a"); v.Add("description", "b") }, "parameter_invalid_string", "description"},
		{"payment_method over maximum", func(v url.Values) { v.Set("payment_method", "pm_"+strings.Repeat("x", 253)) }, "parameter_invalid_string", "payment_method"},
		{"metadata at maximum keys", metadata(50), "", ""},
		{"metadata over maximum keys", metadata(51), "parameter_invalid_string", "metadata"},
		{"metadata key at maximum", func(v url.Values) { v.Set("metadata["+strings.Repeat("ü", 40)+"]", "v") }, "", ""},
		{"metadata key over maximum", func(v url.Values) { v.Set("metadata["+strings.Repeat("k", 41)+"]", "v") }, "parameter_invalid_string", "metadata[" + strings.Repeat("k", 41) + "]"},
		{"metadata value at maximum", func(v url.Values) { v.Set("metadata[k]", strings.Repeat("ü", 500)) }, "", ""},
		{"metadata value over maximum", func(v url.Values) { v.Set("metadata[k]", strings.Repeat("v", 501)) }, "parameter_invalid_string", "metadata[k]"},
		{"metadata nested key", func(v url.Values) { v.Set("metadata[a][b]", "v") }, "parameter_unknown", "metadata[a][b]"},
		{"metadata itself not empty", func(v url.Values) { v.Set("metadata", "x") }, "parameter_invalid_string", "metadata"},
		{"metadata itself empty", func(v url.Values) { v.Set("metadata", "") }, "", ""},
		{"automatic payment methods", func(v url.Values) {
			v.Set("automatic_payment_methods[enabled]", "true")
			v.Set("automatic_payment_methods[allow_redirects]", "never")
		}, "", ""},
		{"automatic payment methods not a boolean", func(v url.Values) { v.Set("automatic_payment_methods[enabled]", "yes") }, "parameter_invalid_string", "automatic_payment_methods[enabled]"},
		{"allow_redirects not an option", func(v url.Values) { v.Set("automatic_payment_methods[allow_redirects]", "sometimes") }, "parameter_invalid_string", "automatic_payment_methods[allow_redirects]"},
		{"expand as stripe-go sends it", func(v url.Values) { v.Set("expand[0]", "latest_charge"); v.Set("expand[1]", "payment_method") }, "", ""},
		{"expand too many", func(v url.Values) {
			for i := range 11 {
				v.Set(fmt.Sprintf("expand[%d]", i), "latest_charge")
			}
		}, "parameter_invalid_string", "expand"},
		{"expand entry too long", func(v url.Values) { v.Set("expand[]", strings.Repeat("x", 256)) }, "parameter_invalid_string", "expand[]"},
		{"unknown parameter", func(v url.Values) { v.Set("receipt_email", "a@example.com") }, "parameter_unknown", "receipt_email"},
		{"unknown nested parameter", func(v url.Values) { v.Set("shipping[name]", "x") }, "parameter_unknown", "shipping[name]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := b.ledger.Len()
			f := chargeForm(500, "pm_card_visa")
			tc.edit(f)
			r := create(t, srv, "key-"+strings.ReplaceAll(tc.name, " ", "-"), f)
			if tc.code == "" {
				wantStatus(t, r, http.StatusOK)
				if got, want := b.ledger.Len(), before+1; got != want {
					t.Errorf("ledger holds %d, want %d", got, want)
				}
				return
			}
			wantStatus(t, r, http.StatusBadRequest)
			e := decodeErr(t, r.body)
			if e.Type != "invalid_request_error" || e.Code != tc.code || e.Param != tc.param {
				t.Errorf("error = %s %s param %q (%s), want invalid_request_error %s param %q", e.Type, e.Code, e.Param, e.Message, tc.code, tc.param)
			}
			if got := b.ledger.Len(); got != before {
				t.Errorf("ledger holds %d, want %d: a refused request charged", got, before)
			}
		})
	}
}

// TestOversizeDescriptionRefusedChargesNothing is the reproduction of issue 8, point 1: a
// description of 1,048,400 "a" (or 175,000 "<", six bytes each in JSON)
// sent twice with one key was charged twice, its answer too large to
// store. It is refused now, each time, and nothing is charged.
func TestOversizeDescriptionRefusedChargesNothing(t *testing.T) {
	for _, tc := range []struct {
		name string
		desc string
	}{
		{"1048400 a", strings.Repeat("a", 1_048_400)},
		{"175000 <", strings.Repeat("<", 175_000)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, b := setup(t, Config{})
			f := chargeForm(500, "pm_card_visa")
			f.Set("description", tc.desc)
			for i := range 2 {
				r := create(t, srv, "one-key", f)
				wantStatus(t, r, http.StatusBadRequest)
				if e := decodeErr(t, r.body); e.Code != "parameter_invalid_string" || e.Param != "description" {
					t.Errorf("attempt %d: error = %s param %q, want parameter_invalid_string param description", i, e.Code, e.Param)
				}
			}
			if got := b.ledger.Len(); got != 0 {
				t.Errorf("ledger holds %d PaymentIntents, want 0", got)
			}
		})
	}
}

// escapedKey returns the i-th of distinct metadata keys of n characters
// that JSON escapes to six bytes each (<, > and &, as \u003c …).
func escapedKey(i, n int) string {
	const escaped = "<>&"
	b := []byte(strings.Repeat("<", n))
	for j := 0; i > 0; j++ {
		b[j] = escaped[i%3]
		i /= 3
	}
	return string(b)
}

// largestForm is the largest valid create request: every string at its
// limit, in characters that JSON escapes to six bytes (for the largest
// answer) or, with wide, in four-byte characters that form encoding makes
// twelve bytes (for the largest request).
func largestForm(pm string, wide bool) url.Values {
	char := "<"
	if wide {
		char = "\U0001F600"
	}
	f := url.Values{
		"amount":                             {fmt.Sprint(MaxAmount)},
		"currency":                           {"eur"},
		"confirm":                            {"true"},
		"payment_method":                     {pm},
		"description":                        {strings.Repeat(char, MaxDescriptionLen)},
		"automatic_payment_methods[enabled]": {"false"},
		"automatic_payment_methods[allow_redirects]": {"always"},
	}
	for i := range MaxExpand {
		f.Set(fmt.Sprintf("expand[%d]", i), strings.Repeat(char, MaxStringLen))
	}
	for i := range MaxMetadataKeys {
		k := escapedKey(i, MaxMetadataKeyLen)
		if wide {
			k = fmt.Sprintf("%02d", i) + strings.Repeat(char, MaxMetadataKeyLen-2)
		}
		f.Set("metadata["+k+"]", strings.Repeat(char, MaxMetadataValueLen))
	}
	return f
}

// TestLargestValidAnswerIsStored: the largest valid request fits the
// request limit, its answer (succeeded, or declined with the
// PaymentIntent in the error) fits the stored-answer limit, and sent
// twice with one key it is charged once and replayed, on every backend.
func TestLargestValidAnswerIsStored(t *testing.T) {
	if n := len(largestForm("pm_card_chargeDeclinedInsufficientFunds", true).Encode()); n >= MaxRequestBody {
		t.Fatalf("the largest valid request is %d bytes, over MaxRequestBody %d", n, MaxRequestBody)
	}
	forEachBackend(t, func(t *testing.T, be testBackend) {
		db := be.open(t, nil)
		srv, _ := setup(t, Config{Store: db.store, Ledger: db.ledger})
		for _, tc := range []struct {
			name   string
			form   url.Values
			status int
		}{
			{"succeeded", largestForm("pm_card_visa", false), http.StatusOK},
			{"declined", largestForm("pm_card_chargeDeclinedInsufficientFunds", false), http.StatusPaymentRequired},
			{"wide characters", largestForm("pm_card_visa", true), http.StatusOK},
		} {
			t.Run(tc.name, func(t *testing.T) {
				before := db.count(t)
				key := "largest-" + strings.ReplaceAll(tc.name, " ", "-")
				first := create(t, srv, key, tc.form)
				wantStatus(t, first, tc.status)
				if n := len(first.body); n >= MaxStoredAnswer || n < 150_000 && tc.name != "wide characters" {
					t.Errorf("answer is %d bytes; want the largest valid one, below MaxStoredAnswer %d", n, MaxStoredAnswer)
				}
				t.Logf("request %d bytes, answer %d bytes", len(tc.form.Encode()), len(first.body))
				again := create(t, srv, key, tc.form)
				wantStatus(t, again, tc.status)
				if got := again.header.Get("Idempotent-Replayed"); got != "true" {
					t.Errorf("Idempotent-Replayed = %q, want true", got)
				}
				if string(again.body) != string(first.body) {
					t.Error("the replay differs from the first answer")
				}
				if got, want := db.count(t), before+1; got != want {
					t.Errorf("ledger holds %d PaymentIntents, want %d", got, want)
				}
			})
		}
	})
}

// TestMaxAnswerBound: the bound on answers computed from the limits,
// every character escaped to six bytes, is below MaxStoredAnswer, and a
// PaymentIntent and a refund built to it encode within it.
func TestMaxAnswerBound(t *testing.T) {
	const perChar = 6 // "<" is \u003c
	strings_ := perChar * (MaxDescriptionLen + MaxMetadataKeys*(MaxMetadataKeyLen+MaxMetadataValueLen))
	// Twice: a decline's error body holds the PaymentIntent and its
	// last_payment_error; 16 KiB for the fixed fields and indentation.
	bound := 2*strings_ + 16<<10
	if bound >= MaxStoredAnswer {
		t.Fatalf("bound %d >= MaxStoredAnswer %d", bound, MaxStoredAnswer)
	}
	desc := strings.Repeat("<", MaxDescriptionLen)
	md := map[string]string{}
	for i := range MaxMetadataKeys {
		md[escapedKey(i, MaxMetadataKeyLen)] = strings.Repeat("<", MaxMetadataValueLen)
	}
	pi := &PaymentIntent{ID: "pi_" + strings.Repeat("x", 24), Object: "payment_intent", Amount: MaxAmount, Description: &desc, Metadata: md,
		PaymentMethod: "pm_card_chargeDeclinedInsufficientFunds", PaymentMethodTypes: []string{"card"}, Currency: "eur", Status: StatusRequiresPaymentMethod,
		LastPaymentError: &PaymentError{Type: "card_error", Code: "card_declined", DeclineCode: "insufficient_funds", Message: declineMessages["insufficient_funds"], DocURL: "https://stripe.com/docs/error-codes/card-declined"}}
	errBody, err := json.MarshalIndent(struct {
		Error *PaymentError `json:"error"`
	}{&PaymentError{Type: "card_error", Code: "card_declined", Message: declineMessages["insufficient_funds"], PaymentIntent: pi}}, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if len(errBody) > bound {
		t.Errorf("largest decline is %d bytes, over the bound %d", len(errBody), bound)
	}
	reason := "requested_by_customer"
	rf, err := json.MarshalIndent(&RefundRecord{ID: "re_" + strings.Repeat("x", 24), Object: "refund", Amount: MaxAmount, Currency: "eur", Metadata: md,
		PaymentIntent: "pi_" + strings.Repeat("x", 24), Reason: &reason, Status: StatusRefundSucceeded}, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if len(rf) > bound {
		t.Errorf("largest refund is %d bytes, over the bound %d", len(rf), bound)
	}
	t.Logf("bound %d, largest decline %d, largest refund %d, MaxStoredAnswer %d", bound, len(errBody), len(rf), MaxStoredAnswer)
}
