package payments

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"log/slog"
	"maps"
	"net/http"
	"strings"
	"time"

	"github.com/stripe/stripe-go/v82"
)

// ErrDeclined matches (errors.Is) the error of a charge the gateway
// declined: a final outcome, which the same idempotency key replays.
var ErrDeclined = errors.New("payments: card declined")

// DefaultMaxNetworkRetries is the default ClientConfig.MaxNetworkRetries.
const DefaultMaxNetworkRetries = 2

// ClientConfig configures a Client.
type ClientConfig struct {
	// BaseURL is the gateway's URL, such as http://127.0.0.1:8081.
	// Default stripe.APIURL: Stripe itself. With InProcess, use
	// InProcessURL.
	BaseURL string
	// APIKey is the secret key. Required.
	APIKey string
	// HTTPClient makes the requests; its Timeout bounds each attempt.
	// Default: an http.Client with an 80 s timeout, as stripe-go's.
	HTTPClient *http.Client
	// MaxNetworkRetries is how many times stripe-go retries a request that
	// failed in a way known to be safe to retry (network errors,
	// lock_timeout, 409, 5xx without an error body), always with the same
	// idempotency key. Default DefaultMaxNetworkRetries; negative means
	// no retries.
	MaxNetworkRetries int
	// Logger receives stripe-go's log lines (at their levels). Default:
	// none. The Client's own warnings (FindByOrderRef finding several
	// payments) go to it, or else to slog.Default().
	Logger *slog.Logger
}

// Client pays through a Stripe-compatible gateway with stripe-go.
type Client struct {
	sc  *stripe.Client
	log *slog.Logger
}

// NewClient returns a Client configured by cfg.
func NewClient(cfg ClientConfig) *Client {
	bc := &stripe.BackendConfig{
		HTTPClient:      cfg.HTTPClient,
		EnableTelemetry: stripe.Bool(false),
		LeveledLogger:   &stripe.LeveledLogger{Level: stripe.LevelNull},
	}
	if bc.HTTPClient == nil {
		bc.HTTPClient = &http.Client{Timeout: 80 * time.Second}
	}
	if cfg.Logger != nil {
		bc.LeveledLogger = slogLeveled{cfg.Logger}
	}
	if cfg.BaseURL != "" {
		bc.URL = stripe.String(cfg.BaseURL)
	}
	switch retries := cfg.MaxNetworkRetries; {
	case retries == 0:
		bc.MaxNetworkRetries = stripe.Int64(DefaultMaxNetworkRetries)
	case retries < 0:
		bc.MaxNetworkRetries = stripe.Int64(0)
	default:
		bc.MaxNetworkRetries = stripe.Int64(int64(retries))
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Client{sc: stripe.NewClient(cfg.APIKey, stripe.WithBackends(stripe.NewBackendsWithConfig(bc))), log: log}
}

// ChargeRequest is one payment.
type ChargeRequest struct {
	// Amount in minor units, > 0.
	Amount int64
	// Currency is a three-letter ISO code, in either case.
	Currency string
	// PaymentMethod defaults to "pm_card_visa".
	PaymentMethod string
	// IdempotencyKey names the payment: every retry of it, by stripe-go or
	// by the caller, must carry the same key. Empty lets stripe-go make
	// one up, which only covers its own retries.
	IdempotencyKey string
	// Metadata is stored with the PaymentIntent.
	Metadata map[string]string
}

// Charge is a PaymentIntent as the Client reports it.
type Charge struct {
	ID       string
	Status   string
	Amount   int64
	Currency string
	Metadata map[string]string
	Created  time.Time
	// Replayed is true when the gateway answered from the idempotency
	// key's stored outcome instead of charging.
	Replayed bool
}

// DeclinedError is the error of a declined charge. It matches ErrDeclined.
type DeclinedError struct {
	// Charge is the PaymentIntent kept with status requires_payment_method,
	// when the gateway reported it.
	Charge      *Charge
	Code        string // "card_declined"
	DeclineCode string // such as "generic_decline" or "insufficient_funds"
	Message     string
}

func (e *DeclinedError) Error() string {
	msg := "payments: card declined"
	if e.DeclineCode != "" {
		msg += " (" + e.DeclineCode + ")"
	}
	if e.Message != "" {
		msg += ": " + e.Message
	}
	return msg
}

// Is reports whether target is ErrDeclined.
func (e *DeclinedError) Is(target error) bool { return target == ErrDeclined }

// Charge creates and confirms a PaymentIntent. A decline is a
// *DeclinedError (errors.Is(err, ErrDeclined)); any other failure is
// wrapped, a gateway error as a *stripe.Error.
func (c *Client) Charge(ctx context.Context, req ChargeRequest) (*Charge, error) {
	if req.PaymentMethod == "" {
		req.PaymentMethod = "pm_card_visa"
	}
	params := &stripe.PaymentIntentCreateParams{
		Amount:        stripe.Int64(req.Amount),
		Currency:      stripe.String(strings.ToLower(req.Currency)),
		Confirm:       stripe.Bool(true),
		PaymentMethod: stripe.String(req.PaymentMethod),
		// Stripe itself needs this to confirm a card without a return_url;
		// the gateway ignores it.
		AutomaticPaymentMethods: &stripe.PaymentIntentCreateAutomaticPaymentMethodsParams{
			Enabled:        stripe.Bool(true),
			AllowRedirects: stripe.String("never"),
		},
		Metadata: maps.Clone(req.Metadata),
	}
	if req.IdempotencyKey != "" {
		params.SetIdempotencyKey(req.IdempotencyKey)
	}
	pi, err := c.sc.V1PaymentIntents.Create(ctx, params)
	if err != nil {
		var se *stripe.Error
		if errors.As(err, &se) && se.Type == stripe.ErrorTypeCard {
			de := &DeclinedError{Code: string(se.Code), DeclineCode: string(se.DeclineCode), Message: se.Msg}
			if se.PaymentIntent != nil {
				de.Charge = chargeOf(se.PaymentIntent)
				de.Charge.Replayed = se.LastResponse != nil && se.LastResponse.Header.Get("Idempotent-Replayed") == "true"
			}
			return nil, de
		}
		return nil, fmt.Errorf("payments: charge: %w", err)
	}
	ch := chargeOf(pi)
	if pi.Status != stripe.PaymentIntentStatusSucceeded {
		return nil, fmt.Errorf("payments: charge: PaymentIntent %s is %s, not succeeded", pi.ID, pi.Status)
	}
	return ch, nil
}

// Get returns the PaymentIntent id; one that does not exist is an error
// matching ErrNotFound.
func (c *Client) Get(ctx context.Context, id string) (*Charge, error) {
	pi, err := c.sc.V1PaymentIntents.Retrieve(ctx, id, nil)
	if err != nil {
		var se *stripe.Error
		if errors.As(err, &se) && se.HTTPStatusCode == http.StatusNotFound {
			return nil, fmt.Errorf("%w: %s: %w", ErrNotFound, id, err)
		}
		return nil, fmt.Errorf("payments: get %s: %w", id, err)
	}
	return chargeOf(pi), nil
}

// All iterates over every PaymentIntent of the account, newest first,
// page by page. It is meant for audits.
func (c *Client) All(ctx context.Context) iter.Seq2[*Charge, error] {
	return func(yield func(*Charge, error) bool) {
		params := &stripe.PaymentIntentListParams{}
		params.Limit = stripe.Int64(MaxListLimit)
		for pi, err := range c.sc.V1PaymentIntents.List(ctx, params) {
			if err != nil {
				yield(nil, fmt.Errorf("payments: list: %w", err))
				return
			}
			if !yield(chargeOf(pi), nil) {
				return
			}
		}
	}
}

// Search iterates over the PaymentIntents that query matches, in Stripe's
// search query language (GET /v1/payment_intents/search), page by page.
// The gateway supports the subset metadata['KEY']:'VALUE' [AND
// status:'STATUS'] (see search.go; QuoteSearchString quotes a value); a
// query it refuses is an error wrapping a *stripe.Error with status 400.
// Stripe's search index lags its writes by up to about a minute; the
// gateway's does not lag.
func (c *Client) Search(ctx context.Context, query string) iter.Seq2[*Charge, error] {
	return func(yield func(*Charge, error) bool) {
		params := &stripe.PaymentIntentSearchParams{}
		params.Query = query
		params.Limit = stripe.Int64(MaxListLimit)
		for pi, err := range c.sc.V1PaymentIntents.Search(ctx, params) {
			if err != nil {
				yield(nil, fmt.Errorf("payments: search: %w", err))
				return
			}
			if !yield(chargeOf(pi), nil) {
				return
			}
		}
	}
}

// FindByOrderRef returns the succeeded PaymentIntent whose
// metadata[order_ref] is orderRef, found with the Search API, or nil, nil
// when there is none. If several succeeded (which paying with one
// idempotency key per order prevents) it logs them and returns the oldest,
// the first made for the order.
//
// Stripe's search is eventually consistent: a payment made within about
// the last minute may not be found yet. A caller must not take "none" to
// mean that nothing was paid unless it pays next with the payment's own
// idempotency key, which dedups for 24 hours (see the order handler).
func (c *Client) FindByOrderRef(ctx context.Context, orderRef string) (*Charge, error) {
	query := "metadata['order_ref']:" + QuoteSearchString(orderRef) + " AND status:'succeeded'"
	var found []*Charge
	for ch, err := range c.Search(ctx, query) {
		if err != nil {
			return nil, fmt.Errorf("payments: finding the payment of order %s: %w", orderRef, err)
		}
		// The query asks for succeeded ones; a gateway that ignored the
		// status clause must not make another status count.
		if ch.Status == string(stripe.PaymentIntentStatusSucceeded) && ch.Metadata["order_ref"] == orderRef {
			found = append(found, ch)
		}
	}
	if len(found) == 0 {
		return nil, nil
	}
	// Results are newest first; the oldest is the last of the earliest
	// second.
	oldest := found[0]
	for _, ch := range found[1:] {
		if !ch.Created.After(oldest.Created) {
			oldest = ch
		}
	}
	if len(found) > 1 {
		ids := make([]string, len(found))
		for i, ch := range found {
			ids[i] = ch.ID
		}
		c.log.WarnContext(ctx, "payments: several succeeded PaymentIntents for one order; using the oldest",
			"order_ref", orderRef, "payment", oldest.ID, "payments", ids)
	}
	return oldest, nil
}

// ByOrderRef returns every PaymentIntent whose metadata[order_ref] is
// orderRef, whatever its status, found with the Search API, newest first.
// Like FindByOrderRef's, its answer may miss a payment made within about
// the last minute (Stripe's index lags its writes).
func (c *Client) ByOrderRef(ctx context.Context, orderRef string) ([]*Charge, error) {
	var found []*Charge
	for ch, err := range c.Search(ctx, "metadata['order_ref']:"+QuoteSearchString(orderRef)) {
		if err != nil {
			return nil, fmt.Errorf("payments: finding the payments of order %s: %w", orderRef, err)
		}
		if ch.Metadata["order_ref"] == orderRef {
			found = append(found, ch)
		}
	}
	return found, nil
}

// Unpaid reports whether a PaymentIntent in status moved no money and
// never will without another confirmation (which the order service
// never sends): canceled, or declined (requires_payment_method). Any
// other status has succeeded, or may still succeed (processing,
// requires_action, requires_capture, requires_confirmation, and any
// status this package does not know).
func Unpaid(status string) bool {
	return status == string(stripe.PaymentIntentStatusCanceled) || status == string(stripe.PaymentIntentStatusRequiresPaymentMethod)
}

func chargeOf(pi *stripe.PaymentIntent) *Charge {
	ch := &Charge{
		ID:       pi.ID,
		Status:   string(pi.Status),
		Amount:   pi.Amount,
		Currency: string(pi.Currency),
		Metadata: pi.Metadata,
		Created:  time.Unix(pi.Created, 0),
	}
	if pi.LastResponse != nil {
		ch.Replayed = pi.LastResponse.Header.Get("Idempotent-Replayed") == "true"
	}
	return ch
}

// slogLeveled adapts a slog.Logger to stripe-go's logger interface.
type slogLeveled struct{ l *slog.Logger }

func (s slogLeveled) Debugf(format string, v ...any) { s.l.Debug(fmt.Sprintf(format, v...)) }
func (s slogLeveled) Infof(format string, v ...any)  { s.l.Info(fmt.Sprintf(format, v...)) }
func (s slogLeveled) Warnf(format string, v ...any)  { s.l.Warn(fmt.Sprintf(format, v...)) }
func (s slogLeveled) Errorf(format string, v ...any) { s.l.Error(fmt.Sprintf(format, v...)) }

// RefundRequest is one refund of a PaymentIntent.
type RefundRequest struct {
	// PaymentIntent is the id of the PaymentIntent to refund (pi_…).
	PaymentIntent string
	// Amount in minor units; 0 refunds all that is not refunded yet.
	Amount int64
	// IdempotencyKey names the refund: every retry of it must carry the
	// same key, and a repeat returns the first refund. Empty lets
	// stripe-go make one up, which only covers its own retries.
	IdempotencyKey string
}

// Refund is a refund as the Client reports it.
type Refund struct {
	ID            string
	PaymentIntent string
	Status        string
	Amount        int64
	// Replayed is true when the gateway answered from the idempotency
	// key's stored outcome instead of refunding.
	Replayed bool
}

// Refund refunds req.Amount (0: the rest) of req.PaymentIntent. A refund
// the gateway refuses is an error that matches (errors.Is) ErrNotFound for
// an unknown PaymentIntent, ErrAlreadyRefunded when nothing is left to
// refund, ErrRefundTooLarge when req.Amount is more than is left, and
// ErrNotRefundable when the PaymentIntent did not succeed; any other
// failure is wrapped, a gateway error as a *stripe.Error.
func (c *Client) Refund(ctx context.Context, req RefundRequest) (*Refund, error) {
	params := &stripe.RefundCreateParams{PaymentIntent: stripe.String(req.PaymentIntent)}
	if req.Amount != 0 {
		params.Amount = stripe.Int64(req.Amount)
	}
	if req.IdempotencyKey != "" {
		params.SetIdempotencyKey(req.IdempotencyKey)
	}
	r, err := c.sc.V1Refunds.Create(ctx, params)
	if err != nil {
		return nil, fmt.Errorf("payments: refund %s: %w", req.PaymentIntent, refundError(err))
	}
	return refundOf(r), nil
}

// Refunds returns every refund of the PaymentIntent paymentIntent, newest
// first.
func (c *Client) Refunds(ctx context.Context, paymentIntent string) ([]*Refund, error) {
	var out []*Refund
	for r, err := range c.listRefunds(ctx, paymentIntent) {
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, nil
}

// AllRefunds iterates over every refund of the account, whatever its
// PaymentIntent, newest first, page by page (GET /v1/refunds without a
// payment_intent, as Stripe lists them). It is meant for audits: one
// listing instead of one per PaymentIntent.
func (c *Client) AllRefunds(ctx context.Context) iter.Seq2[*Refund, error] {
	return c.listRefunds(ctx, "")
}

// listRefunds iterates over the refunds of the PaymentIntent paymentIntent
// ("": of every PaymentIntent of the account), newest first, page by page,
// and stops at the first error.
func (c *Client) listRefunds(ctx context.Context, paymentIntent string) iter.Seq2[*Refund, error] {
	return func(yield func(*Refund, error) bool) {
		params := &stripe.RefundListParams{}
		what := "list refunds"
		if paymentIntent != "" {
			params.PaymentIntent = stripe.String(paymentIntent)
			what = "refunds of " + paymentIntent
		}
		params.Limit = stripe.Int64(MaxListLimit)
		for r, err := range c.sc.V1Refunds.List(ctx, params) {
			if err != nil {
				yield(nil, fmt.Errorf("payments: %s: %w", what, refundError(err)))
				return
			}
			if !yield(refundOf(r), nil) {
				return
			}
		}
	}
}

// refundError makes the gateway's refusals of a refund match this
// package's errors, keeping the *stripe.Error.
func refundError(err error) error {
	var se *stripe.Error
	if !errors.As(err, &se) {
		return err
	}
	switch {
	case se.HTTPStatusCode == http.StatusNotFound || se.Code == stripe.ErrorCodeResourceMissing:
		return fmt.Errorf("%w: %w", ErrNotFound, err)
	case se.Code == stripe.ErrorCodeChargeAlreadyRefunded:
		return fmt.Errorf("%w: %w", ErrAlreadyRefunded, err)
	case se.Code == stripe.ErrorCodeAmountTooLarge:
		return fmt.Errorf("%w: %w", ErrRefundTooLarge, err)
	case se.Code == stripe.ErrorCodePaymentIntentUnexpectedState, se.Code == stripe.ErrorCodeChargeNotRefundable:
		return fmt.Errorf("%w: %w", ErrNotRefundable, err)
	}
	return err
}

func refundOf(r *stripe.Refund) *Refund {
	out := &Refund{ID: r.ID, Status: string(r.Status), Amount: r.Amount}
	if r.PaymentIntent != nil {
		out.PaymentIntent = r.PaymentIntent.ID
	}
	if r.LastResponse != nil {
		out.Replayed = r.LastResponse.Header.Get("Idempotent-Replayed") == "true"
	}
	return out
}
