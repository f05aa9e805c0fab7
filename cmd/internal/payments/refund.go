package payments

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
)

// Errors of refunds, from a Ledger and from Client.Refund. A PaymentIntent
// that does not exist is ErrNotFound.
var (
	// ErrNotRefundable: the PaymentIntent did not succeed, so there is
	// nothing to refund.
	ErrNotRefundable = errors.New("payments: the PaymentIntent has no successful payment to refund")
	// ErrAlreadyRefunded: the PaymentIntent is refunded in full.
	ErrAlreadyRefunded = errors.New("payments: the PaymentIntent is already refunded in full")
	// ErrRefundTooLarge: the amount is more than is left to refund.
	ErrRefundTooLarge = errors.New("payments: the refund is larger than what is left to refund")
)

// StatusRefundSucceeded is the status of every refund the gateway makes.
const StatusRefundSucceeded = "succeeded"

// RefundRecord is the gateway's record of one refund, encoded as Stripe
// encodes a Refund object.
type RefundRecord struct {
	ID                 string            `json:"id"`
	Object             string            `json:"object"`
	Amount             int64             `json:"amount"`
	BalanceTransaction *string           `json:"balance_transaction"`
	Charge             *string           `json:"charge"`
	Created            int64             `json:"created"`
	Currency           string            `json:"currency"`
	Metadata           map[string]string `json:"metadata"`
	PaymentIntent      string            `json:"payment_intent"`
	Reason             *string           `json:"reason"`
	Status             string            `json:"status"`

	// Account is the account the refund belongs to, that of its
	// PaymentIntent. It is not part of Stripe's object.
	Account string `json:"-"`
}

// Clone returns a deep copy of r.
func (r *RefundRecord) Clone() *RefundRecord {
	c := *r
	c.Metadata = maps.Clone(r.Metadata)
	if r.Reason != nil {
		s := *r.Reason
		c.Reason = &s
	}
	return &c
}

// RefundQuery selects a page of refunds, newest first, by key set as
// ListQuery does. PaymentIntent, when set, keeps only that PaymentIntent's
// refunds. A cursor that does not exist is ErrNotFound.
type RefundQuery struct {
	Account       string
	PaymentIntent string
	Limit         int // 1..MaxListLimit; out of range means DefaultListLimit
	StartingAfter string
	EndingBefore  string
}

func (q RefundQuery) limit() int { return ListQuery{Limit: q.Limit}.limit() }

// RefundPage is one page of refunds, newest first.
type RefundPage struct {
	Data    []*RefundRecord
	HasMore bool
}

// ListAllRefunds returns every refund of account's PaymentIntent
// paymentIntent in l (every refund of account when paymentIntent is
// empty), newest first, by paging through ListRefunds. It is meant for
// audits and tests.
func ListAllRefunds(ctx context.Context, l Ledger, account, paymentIntent string) ([]*RefundRecord, error) {
	var all []*RefundRecord
	q := RefundQuery{Account: account, PaymentIntent: paymentIntent, Limit: MaxListLimit}
	for {
		p, err := l.ListRefunds(ctx, q)
		if err != nil {
			return nil, err
		}
		all = append(all, p.Data...)
		if !p.HasMore || len(p.Data) == 0 {
			return all, nil
		}
		q.StartingAfter = p.Data[len(p.Data)-1].ID
	}
}

// refundAmount checks a refund of r.Amount (0: all that is left) of a
// PaymentIntent with status that received received and of which refunded
// is given back already (or held for refunds still running), and sets
// r.Amount to what is refunded. The Ledgers call it with the
// PaymentIntent locked.
func refundAmount(r *RefundRecord, status string, received, refunded int64) error {
	left := received - refunded
	switch {
	case status != StatusSucceeded:
		return fmt.Errorf("%w: %s is %s", ErrNotRefundable, r.PaymentIntent, status)
	case left <= 0:
		return fmt.Errorf("%w: %s", ErrAlreadyRefunded, r.PaymentIntent)
	case r.Amount == 0:
		r.Amount = left
	case r.Amount > left:
		return &refundTooLargeError{requested: r.Amount, left: left}
	}
	return nil
}

// refundTooLargeError is ErrRefundTooLarge with the amounts.
type refundTooLargeError struct{ requested, left int64 }

func (e *refundTooLargeError) Error() string {
	return fmt.Sprintf("%v: %d requested, %d left", ErrRefundTooLarge, e.requested, e.left)
}

func (e *refundTooLargeError) Is(target error) bool { return target == ErrRefundTooLarge }

// refundParams are the parameters of POST /v1/refunds.
type refundParams struct {
	paymentIntent string
	amount        int64 // 0: the rest
	reason        *string
	metadata      map[string]string
}

// parseRefundParams reads the parameters of POST /v1/refunds within the
// limits documented in params.go.
func parseRefundParams(v url.Values) (*refundParams, error) {
	ps := newParams(v)
	p := &refundParams{}
	var err error
	if p.paymentIntent, err = ps.required("payment_intent", MaxStringLen); err != nil {
		return nil, err
	}
	if p.amount, _, err = ps.integer("amount", MinAmount, MaxAmount); err != nil {
		return nil, err
	}
	reason, ok, err := ps.oneOf("reason", "duplicate", "fraudulent", "requested_by_customer")
	if err != nil {
		return nil, err
	}
	if ok {
		p.reason = &reason
	}
	if p.metadata, err = ps.metadata(); err != nil {
		return nil, err
	}
	if err := ps.expand(); err != nil {
		return nil, err
	}
	if err := ps.unknown(); err != nil {
		return nil, err
	}
	return p, nil
}

// createRefund refunds a PaymentIntent. Under the idempotency middleware
// its ledger write commits together with the stored response.
func (s *Server) createRefund(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	w.Header().Set("Original-Request", requestIDFrom(ctx))
	v, ok := s.readForm(w, r)
	if !ok {
		return
	}
	p, err := parseRefundParams(v)
	if err != nil {
		var pe *paramError
		errors.As(err, &pe)
		writeParamError(w, pe.param, pe.code, pe.msg)
		return
	}
	rf := &RefundRecord{
		ID:            newID("re_", 24),
		Object:        "refund",
		Amount:        p.amount,
		Created:       s.cfg.Now().Unix(),
		Metadata:      p.metadata,
		PaymentIntent: p.paymentIntent,
		Reason:        p.reason,
		Status:        StatusRefundSucceeded,
		Account:       accountFrom(ctx),
	}
	err = s.ledger.CreateRefund(ctx, rf)
	var tooLarge *refundTooLargeError
	switch {
	case errors.Is(err, ErrNotFound):
		writeError(w, http.StatusNotFound, &PaymentError{Type: "invalid_request_error", Code: "resource_missing", Param: "payment_intent", Message: fmt.Sprintf("No such payment_intent: '%s'", p.paymentIntent)})
	case errors.Is(err, ErrNotRefundable):
		writeError(w, http.StatusBadRequest, &PaymentError{Type: "invalid_request_error", Code: "payment_intent_unexpected_state", Param: "payment_intent", Message: fmt.Sprintf("This PaymentIntent (%s) does not have a successful payment to refund.", p.paymentIntent)})
	case errors.Is(err, ErrAlreadyRefunded):
		writeError(w, http.StatusBadRequest, &PaymentError{Type: "invalid_request_error", Code: "charge_already_refunded", Message: fmt.Sprintf("The payment of PaymentIntent %s has already been refunded.", p.paymentIntent)})
	case errors.As(err, &tooLarge):
		writeError(w, http.StatusBadRequest, &PaymentError{Type: "invalid_request_error", Code: "amount_too_large", Param: "amount", Message: fmt.Sprintf("Refund amount (%d) is greater than the amount not yet refunded on PaymentIntent %s (%d).", tooLarge.requested, p.paymentIntent, tooLarge.left)})
	case err != nil:
		s.internalError(w, r, "refund", err)
	default:
		writeJSON(w, http.StatusOK, rf)
	}
}

// listRefunds answers GET /v1/refunds.
func (s *Server) listRefunds(w http.ResponseWriter, r *http.Request) {
	lq, ok := s.readListQuery(w, r, "payment_intent")
	if !ok {
		return
	}
	q := RefundQuery{Account: accountFrom(r.Context()), PaymentIntent: lq.filter, Limit: lq.Limit, StartingAfter: lq.StartingAfter, EndingBefore: lq.EndingBefore}
	p, err := s.ledger.ListRefunds(r.Context(), q)
	switch {
	case errors.Is(err, ErrNotFound):
		lq.writeCursorMissing(w, "refund")
		return
	case err != nil:
		s.internalError(w, r, "list refunds", err)
		return
	}
	if p.Data == nil {
		p.Data = []*RefundRecord{}
	}
	writeJSON(w, http.StatusOK, refundList{Object: "list", Data: p.Data, HasMore: p.HasMore, URL: "/v1/refunds"})
}
