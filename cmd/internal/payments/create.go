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
	"strings"
	"time"
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

// createParams are the parameters of POST /v1/payment_intents that the
// gateway acts on.
type createParams struct {
	amount        int64
	currency      string
	paymentMethod string
	description   *string
	metadata      map[string]string
}

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
// them does not matter. It never refuses a request.
func fingerprint(r *http.Request, body []byte) (string, error) {
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
	return hex.EncodeToString(h.Sum(nil)), nil
}

// parseCreateParams reads the parameters of POST /v1/payment_intents
// within the limits documented in params.go.
func parseCreateParams(v url.Values) (*createParams, error) {
	ps := newParams(v)
	c := &createParams{}
	amount, ok, err := ps.integer("amount", MinAmount, MaxAmount)
	switch {
	case err != nil:
		return nil, err
	case !ok:
		return nil, &paramError{"amount", codeMissing, "Missing required param: amount."}
	}
	c.amount = amount

	cur, err := ps.required("currency", MaxStringLen)
	if err != nil {
		return nil, err
	}
	if !IsCurrency(cur) {
		return nil, &paramError{"currency", codeInvalidString, fmt.Sprintf("Invalid currency: %s. A currency is a three-letter ISO 4217 code in lower case, such as eur.", truncate(cur, 40))}
	}
	c.currency = strings.ToLower(cur)

	if _, ok, err := ps.oneOf("confirm", "true"); err != nil || !ok {
		return nil, &paramError{"confirm", codeInvalidString, "This gateway only creates PaymentIntents with confirm=true."}
	}

	if c.paymentMethod, err = ps.required("payment_method", MaxStringLen); err != nil {
		return nil, err
	}
	if _, ok := paymentMethods[c.paymentMethod]; !ok {
		return nil, &paramError{"payment_method", "resource_missing", fmt.Sprintf("No such PaymentMethod: '%s'", c.paymentMethod)}
	}

	d, ok, err := ps.str("description", MaxDescriptionLen)
	if err != nil {
		return nil, err
	}
	if ok && d != "" {
		c.description = &d
	}

	if c.metadata, err = ps.metadata(); err != nil {
		return nil, err
	}
	// Stripe itself needs these to confirm a card without a return_url;
	// the gateway checks and ignores them.
	if _, _, err := ps.oneOf("automatic_payment_methods[enabled]", "true", "false"); err != nil {
		return nil, err
	}
	if _, _, err := ps.oneOf("automatic_payment_methods[allow_redirects]", "always", "never"); err != nil {
		return nil, err
	}
	if err := ps.expand(); err != nil {
		return nil, err
	}
	if err := ps.unknown(); err != nil {
		return nil, err
	}
	return c, nil
}

// createIntent creates and confirms a PaymentIntent. Under the idempotency
// middleware its ledger write commits together with the stored response.
func (s *Server) createIntent(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	reqID := requestIDFrom(ctx)
	// Replays carry the ID of the request that made the outcome, as at Stripe.
	w.Header().Set("Original-Request", reqID)

	v, ok := s.readForm(w, r)
	if !ok {
		return
	}
	p, err := parseCreateParams(v)
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
	if s.cfg.Hold != nil {
		s.cfg.Hold()
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
		if errors.Is(err, ErrLedgerFull) {
			writeError(w, http.StatusServiceUnavailable, &PaymentError{Type: "api_error",
				Message: "This gateway keeps its PaymentIntents in memory and holds as many as it may; nothing was charged. Restart it, or give it a --database-url."})
			return
		}
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
