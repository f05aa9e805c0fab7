package payments

import (
	"context"
	"errors"
	"maps"
)

// ErrNotFound is returned for a PaymentIntent that does not exist or that
// belongs to another account.
var ErrNotFound = errors.New("payments: no such payment_intent")

// PaymentIntent statuses used by the gateway.
const (
	StatusSucceeded             = "succeeded"
	StatusRequiresPaymentMethod = "requires_payment_method"
)

// PaymentIntent is the gateway's record of one payment, encoded as Stripe
// encodes it.
type PaymentIntent struct {
	ID                 string            `json:"id"`
	Object             string            `json:"object"`
	Amount             int64             `json:"amount"`
	AmountCapturable   int64             `json:"amount_capturable"`
	AmountReceived     int64             `json:"amount_received"`
	CaptureMethod      string            `json:"capture_method"`
	ConfirmationMethod string            `json:"confirmation_method"`
	Created            int64             `json:"created"`
	Currency           string            `json:"currency"`
	Description        *string           `json:"description"`
	LastPaymentError   *PaymentError     `json:"last_payment_error"`
	Livemode           bool              `json:"livemode"`
	Metadata           map[string]string `json:"metadata"`
	PaymentMethod      string            `json:"payment_method"`
	PaymentMethodTypes []string          `json:"payment_method_types"`
	Status             string            `json:"status"`

	// Account is the account the PaymentIntent belongs to: derived from
	// the API key it was created with. It is not part of Stripe's object.
	Account string `json:"-"`
	// AmountRefunded is how much of AmountReceived its refunds gave back.
	// Stripe shows it on the PaymentIntent's charge, which this gateway
	// does not have; the Ledger keeps it for refunds.
	AmountRefunded int64 `json:"-"`
}

// PaymentError is a Stripe error object, as found in last_payment_error and
// in error responses.
type PaymentError struct {
	Type          string         `json:"type"`
	Code          string         `json:"code,omitempty"`
	DeclineCode   string         `json:"decline_code,omitempty"`
	Message       string         `json:"message"`
	Param         string         `json:"param,omitempty"`
	DocURL        string         `json:"doc_url,omitempty"`
	PaymentIntent *PaymentIntent `json:"payment_intent,omitempty"`
}

// Clone returns a deep copy of pi.
func (pi *PaymentIntent) Clone() *PaymentIntent {
	c := *pi
	c.Metadata = maps.Clone(pi.Metadata)
	c.PaymentMethodTypes = append([]string(nil), pi.PaymentMethodTypes...)
	if pi.LastPaymentError != nil {
		e := *pi.LastPaymentError
		c.LastPaymentError = &e
	}
	if pi.Description != nil {
		d := *pi.Description
		c.Description = &d
	}
	return &c
}

// Ledger keeps PaymentIntents. Implementations are safe for concurrent use.
type Ledger interface {
	// Create records pi. When ctx belongs to a request claimed by
	// idem.Middleware, the write joins that request's transaction and
	// takes effect only if its outcome commits; without one (a request
	// without an Idempotency-Key) it is written at once.
	Create(ctx context.Context, pi *PaymentIntent) error
	// Get returns the PaymentIntent id of account, or ErrNotFound.
	Get(ctx context.Context, account, id string) (*PaymentIntent, error)
	// List returns a page of account's PaymentIntents, newest first.
	List(ctx context.Context, q ListQuery) (Page, error)
	// Search returns a page of q.Account's PaymentIntents whose metadata
	// (and status, when q.Status is set) q matches, newest first. It sees
	// every committed PaymentIntent at once.
	Search(ctx context.Context, q SearchQuery) (Page, error)

	// CreateRefund records the refund r of r.Amount (0: all that is not
	// refunded yet, which it then sets) of the PaymentIntent
	// r.PaymentIntent of r.Account, setting r.Currency to its. It checks
	// and adds to the PaymentIntent's AmountRefunded atomically, so that
	// concurrent refunds never give back more than was received: the
	// PaymentIntent must exist (else ErrNotFound) and have succeeded
	// (ErrNotRefundable), something must be left to refund
	// (ErrAlreadyRefunded) and r.Amount be at most that
	// (ErrRefundTooLarge). Inside an idempotent request the refund joins
	// the request's transaction, as Create does.
	CreateRefund(ctx context.Context, r *RefundRecord) error
	// ListRefunds returns a page of account's refunds, newest first.
	ListRefunds(ctx context.Context, q RefundQuery) (RefundPage, error)
}

// ListQuery selects a page of PaymentIntents. Pagination is by key set:
// StartingAfter and EndingBefore name the PaymentIntent the page starts
// after (older ones) or ends before (newer ones); at most one is set. A
// cursor that does not exist is ErrNotFound.
type ListQuery struct {
	Account       string
	Limit         int // 1..MaxListLimit; out of range means DefaultListLimit
	StartingAfter string
	EndingBefore  string

	// bulk, when set, is the page size, over MaxListLimit: EachIntent's.
	bulk int
}

// Page is one page of a list, newest first.
type Page struct {
	Data    []*PaymentIntent
	HasMore bool
}

// List limits, as Stripe has them.
const (
	DefaultListLimit = 10
	MaxListLimit     = 100
)

func (q ListQuery) limit() int {
	if q.bulk > 0 {
		return q.bulk
	}
	if q.Limit < 1 || q.Limit > MaxListLimit {
		return DefaultListLimit
	}
	return q.Limit
}

// eachIntentPage is how many PaymentIntents one page of EachIntent reads.
const eachIntentPage = 2000

// EachIntent calls fn with every PaymentIntent of account in l, newest
// first, from pages of eachIntentPage read straight from the ledger (not
// through the API, whose pages hold at most MaxListLimit). It is meant for
// an audit in the gateway's own process; it holds one page at a time and
// stops at fn's first error.
func EachIntent(ctx context.Context, l Ledger, account string, fn func(*PaymentIntent) error) error {
	q := ListQuery{Account: account, bulk: eachIntentPage}
	for {
		p, err := l.List(ctx, q)
		if err != nil {
			return err
		}
		for _, pi := range p.Data {
			if err := fn(pi); err != nil {
				return err
			}
		}
		if !p.HasMore || len(p.Data) == 0 {
			return nil
		}
		q.StartingAfter = p.Data[len(p.Data)-1].ID
	}
}

// ListAll returns every PaymentIntent of account in l, newest first, by
// paging through List. It is meant for audits and tests.
func ListAll(ctx context.Context, l Ledger, account string) ([]*PaymentIntent, error) {
	var all []*PaymentIntent
	q := ListQuery{Account: account, Limit: MaxListLimit}
	for {
		p, err := l.List(ctx, q)
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
