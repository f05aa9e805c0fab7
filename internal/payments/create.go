package payments

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/idem-go/idem"
)

// Test payment methods, as Stripe names them. Any other is a missing
// resource.
var paymentMethods = map[string]string{ // payment method → decline code, "" succeeds
	"pm_card_visa":                            "",
	"pm_card_visa_debit":                      "",
	"pm_card_mastercard":                      "",
	"pm_card_amex":                            "",
	"pm_card_chargeDeclined":                  "generic_decline",
	"pm_card_chargeDeclinedInsufficientFunds": "insufficient_funds",
}

var declineMessages = map[string]string{
	"generic_decline":    "Your card was declined.",
	"insufficient_funds": "Your card has insufficient funds.",
}

// Stripe's metadata limits.
const (
	maxMetadataKeys     = 50
	maxMetadataKeyLen   = 40
	maxMetadataValueLen = 500
)

// createParams are the parameters of POST /v1/payment_intents that the
// gateway acts on; the others are accepted and ignored.
type createParams struct {
	amount        int64
	currency      string
	paymentMethod string
	description   *string
	metadata      map[string]string
}

// paramError is a 400 invalid_request_error about one parameter.
type paramError struct {
	param, code, msg string
}

func (e *paramError) Error() string { return e.msg }

// requestParams reads the form parameters of a POST from its query and its
// form-encoded body.
func requestParams(r *http.Request, body []byte) (url.Values, error) {
	if ct := r.Header.Get("Content-Type"); ct != "" && len(body) > 0 {
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil || mt != "application/x-www-form-urlencoded" {
			return nil, &paramError{msg: "Invalid request: the body must be application/x-www-form-urlencoded, not " + ct + "."}
		}
	}
	v, err := url.ParseQuery(r.URL.RawQuery)
	if err != nil {
		return nil, &paramError{msg: "Invalid request: the query string is not form-encoded."}
	}
	bv, err := url.ParseQuery(string(body))
	if err != nil {
		return nil, &paramError{msg: "Invalid request: the body is not form-encoded."}
	}
	for k, vs := range bv {
		v[k] = append(v[k], vs...)
	}
	return v, nil
}

// fingerprint identifies a create request by method, path and its
// parameters sorted by name, so that the order in which a client encodes
// them does not matter.
func fingerprint(r *http.Request, body []byte) string {
	h := sha256.New()
	io.WriteString(h, r.Method)
	h.Write([]byte{0})
	io.WriteString(h, r.URL.EscapedPath())
	h.Write([]byte{0})
	if v, err := requestParams(r, body); err == nil {
		io.WriteString(h, "form\x00")
		io.WriteString(h, v.Encode()) // Encode sorts by name
	} else {
		io.WriteString(h, "raw\x00")
		h.Write(body)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func parseCreateParams(v url.Values) (*createParams, error) {
	p := &createParams{metadata: map[string]string{}}

	amount := v.Get("amount")
	if amount == "" {
		return nil, &paramError{"amount", "parameter_missing", "Missing required param: amount."}
	}
	n, err := strconv.ParseInt(amount, 10, 64)
	if err != nil {
		return nil, &paramError{"amount", "parameter_invalid_integer", "Invalid integer: " + amount}
	}
	if n < 1 {
		return nil, &paramError{"amount", "parameter_invalid_integer", "This value must be greater than or equal to 1."}
	}
	p.amount = n

	cur := v.Get("currency")
	if cur == "" {
		return nil, &paramError{"currency", "parameter_missing", "Missing required param: currency."}
	}
	if len(cur) != 3 || strings.IndexFunc(cur, func(c rune) bool { return !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z') }) >= 0 {
		return nil, &paramError{"currency", "parameter_invalid_string", fmt.Sprintf("Invalid currency: %s. A currency is a three-letter ISO code.", cur)}
	}
	p.currency = strings.ToLower(cur)

	if c := v.Get("confirm"); c != "true" {
		return nil, &paramError{"confirm", "parameter_invalid_string", "This gateway only creates PaymentIntents with confirm=true."}
	}

	p.paymentMethod = v.Get("payment_method")
	if p.paymentMethod == "" {
		return nil, &paramError{"payment_method", "parameter_missing", "Missing required param: payment_method."}
	}
	if _, ok := paymentMethods[p.paymentMethod]; !ok {
		return nil, &paramError{"payment_method", "resource_missing", fmt.Sprintf("No such PaymentMethod: '%s'", p.paymentMethod)}
	}

	if d, ok := v["description"]; ok && len(d) > 0 && d[0] != "" {
		if !storable(d[0]) {
			return nil, &paramError{"description", "parameter_invalid_string", "Invalid string: the description must be UTF-8 text without NUL characters."}
		}
		p.description = &d[0]
	}

	for name, vs := range v {
		if name == "metadata" {
			continue // metadata= (empty) clears metadata: nothing to do on create
		}
		k, ok := strings.CutPrefix(name, "metadata[")
		if !ok {
			continue
		}
		k, ok = strings.CutSuffix(k, "]")
		if !ok || k == "" || strings.ContainsAny(k, "[]") {
			return nil, &paramError{name, "parameter_unknown", fmt.Sprintf("Invalid metadata key: %q.", name)}
		}
		if !storable(k) || !storable(vs[0]) {
			return nil, &paramError{name, "parameter_invalid_string", "Invalid string: metadata keys and values must be UTF-8 text without NUL characters."}
		}
		if len(k) > maxMetadataKeyLen {
			return nil, &paramError{name, "", fmt.Sprintf("Metadata keys can be at most %d characters long.", maxMetadataKeyLen)}
		}
		if val := vs[0]; val != "" {
			if len(val) > maxMetadataValueLen {
				return nil, &paramError{name, "", fmt.Sprintf("Metadata values can be at most %d characters long.", maxMetadataValueLen)}
			}
			p.metadata[k] = val
		}
	}
	if len(p.metadata) > maxMetadataKeys {
		return nil, &paramError{"metadata", "", fmt.Sprintf("Metadata can have at most %d keys.", maxMetadataKeys)}
	}
	return p, nil
}

// storable reports whether s is text that every ledger keeps as it is:
// valid UTF-8 without NUL, which PostgreSQL's text and jsonb refuse.
func storable(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

// createIntent creates and confirms a PaymentIntent. Under the idempotency
// middleware its ledger write commits together with the stored response.
func (s *Server) createIntent(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	reqID := requestIDFrom(ctx)
	// Replays carry the ID of the request that made the outcome, as at Stripe.
	w.Header().Set("Original-Request", reqID)

	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, idem.DefaultMaxRequestBody))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			writeError(w, http.StatusRequestEntityTooLarge, &PaymentError{Type: "invalid_request_error", Message: "The request body is too large."})
			return
		}
		writeError(w, http.StatusBadRequest, &PaymentError{Type: "invalid_request_error", Message: "Could not read the request body."})
		return
	}
	v, err := requestParams(r, body)
	var p *createParams
	if err == nil {
		p, err = parseCreateParams(v)
	}
	if err != nil {
		var pe *paramError
		errors.As(err, &pe)
		writeParamError(w, pe.param, pe.code, pe.msg)
		return
	}

	if s.cfg.Latency > 0 {
		// A real gateway goes on charging when its client gives up, so
		// the request's cancellation is not heeded.
		time.Sleep(s.cfg.Latency)
	}

	pi := &PaymentIntent{
		ID:                 newID("pi_", 24),
		Object:             "payment_intent",
		Amount:             p.amount,
		CaptureMethod:      "automatic",
		ConfirmationMethod: "automatic",
		Created:            s.cfg.Now().Unix(),
		Currency:           p.currency,
		Description:        p.description,
		Metadata:           p.metadata,
		PaymentMethod:      p.paymentMethod,
		PaymentMethodTypes: []string{"card"},
		Account:            accountFrom(ctx),
	}
	decline := paymentMethods[p.paymentMethod]
	if decline == "" && s.cfg.DeclineOver > 0 && p.amount > s.cfg.DeclineOver {
		decline = "insufficient_funds"
	}
	var perr *PaymentError
	if decline == "" {
		pi.Status = StatusSucceeded
		pi.AmountReceived = p.amount
	} else {
		pi.Status = StatusRequiresPaymentMethod
		perr = &PaymentError{
			Type:        "card_error",
			Code:        "card_declined",
			DeclineCode: decline,
			Message:     declineMessages[decline],
			DocURL:      "https://stripe.com/docs/error-codes/card-declined",
		}
		lpe := *perr
		pi.LastPaymentError = &lpe
	}

	if err := s.ledger.Create(ctx, pi); err != nil {
		s.internalError(w, r, "create", err)
		return
	}
	if perr != nil {
		perr.PaymentIntent = pi
		writeError(w, http.StatusPaymentRequired, perr)
		return
	}
	writeJSON(w, http.StatusOK, pi)
}
