package ordersapp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
)

// externalKeyRetention is how long an external gateway (Stripe, or
// `payments serve`) keeps an idempotency key: serve must refuse a
// --key-ttl above it when --payments-url is set, or an order key retried
// after the gateway forgot its payment key would pay a second time.
const externalKeyRetention = payments.DefaultKeyRetention

// payer pays for orders through the gateway's Stripe-compatible API.
type payer struct {
	c *payments.Client
	// gw is the in-process gateway, nil for an external one; ledger its
	// ledger and account the account of the API key, which the audit
	// lists straight from the ledger.
	gw      *payments.Server
	ledger  payments.Ledger
	account string
}

var _ orders.Payer = payer{}

// gatewayKeyRetention is how long the in-process gateway keeps its
// idempotency keys: the service's --key-ttl, and never less than Stripe's
// 24 hours. A payment key is made after its order key, so with the same
// retention it outlives it; the floor also covers an order key that
// outlives its TTL unanswered (a late completion, the completer's
// re-drives after a crash, a lease longer than a short TTL), whose
// re-drive must still find the payment key and replay it. Keeping a key
// longer never makes a wrong replay: a new operation on an expired order
// key has a new creation time, so a new payment key.
func gatewayKeyRetention(c *Config) time.Duration {
	return max(c.KeyTTL, payments.DefaultKeyRetention)
}

// newPayer returns a payer for the gateway at c.PaymentsURL or, when it is
// empty, for an in-process gateway (the same handler behind an in-memory
// transport, no socket) that keeps its state in be's database and its
// idempotency keys for gatewayKeyRetention(c). The ledger is the
// in-process gateway's, nil for an external one.
func newPayer(ctx context.Context, c *Config, be *backend) (payer, payments.Ledger, error) {
	cfg := payments.ClientConfig{BaseURL: c.PaymentsURL, APIKey: c.PaymentsKey, MaxNetworkRetries: 3}
	if c.PaymentsURL != "" {
		cfg.HTTPClient = &http.Client{}
		return payer{c: payments.NewClient(cfg)}, nil, nil
	}
	store, ledger, err := be.gateway(ctx)
	if err != nil {
		return payer{}, nil, err
	}
	gw := payments.NewServer(payments.Config{
		APIKey:       c.PaymentsKey,
		Store:        store,
		Ledger:       ledger,
		KeyRetention: gatewayKeyRetention(c),
		Latency:      c.gatewayLatency,
		Hold:         c.gatewayHold,
		DeclineOver:  c.gatewayDeclineOver,
	})
	cfg.BaseURL = payments.InProcessURL
	cfg.HTTPClient = payments.InProcess(gw)
	return payer{c: payments.NewClient(cfg), gw: gw, ledger: ledger, account: payments.AccountFor(c.PaymentsKey)}, ledger, nil
}

func (p payer) Pay(ctx context.Context, req orders.PaymentRequest) (orders.PaymentResult, error) {
	ch, err := p.c.Charge(ctx, payments.ChargeRequest{
		Amount:         req.Amount,
		Currency:       strings.ToLower(req.Currency),
		PaymentMethod:  "pm_card_visa",
		IdempotencyKey: req.IdempotencyKey,
		Metadata:       map[string]string{"order_ref": req.OrderRef},
	})
	switch {
	case errors.Is(err, payments.ErrDeclined):
		return orders.PaymentResult{}, fmt.Errorf("%w: %w", orders.ErrDeclined, err)
	case err != nil:
		return orders.PaymentResult{}, err
	}
	return orders.PaymentResult{ID: ch.ID}, nil
}

// FindPayment looks the order's payment up at the gateway by its
// metadata[order_ref], with Stripe's Search API (see
// payments.Client.FindByOrderRef): the oldest succeeded PaymentIntent for
// orderRef, if there is one.
func (p payer) FindPayment(ctx context.Context, orderRef string) (orders.PaymentResult, bool, error) {
	ch, err := p.c.FindByOrderRef(ctx, orderRef)
	if err != nil || ch == nil {
		return orders.PaymentResult{}, false, err
	}
	return orders.PaymentResult{ID: ch.ID}, true, nil
}

// paymentsOf returns every PaymentIntent made for orderRef, whatever its
// status (see payments.Client.ByOrderRef).
func (p payer) paymentsOf(ctx context.Context, orderRef string) ([]*payments.Charge, error) {
	return p.c.ByOrderRef(ctx, orderRef)
}

// Refund refunds req.PaymentID in full with req.IdempotencyKey: a repeat
// of the key replays the first refund. A payment with nothing left to
// refund is success too: the key's own refund is then already made (or the
// payment was refunded otherwise), and a second refund is not possible.
func (p payer) Refund(ctx context.Context, req orders.RefundRequest) error {
	_, err := p.c.Refund(ctx, payments.RefundRequest{PaymentIntent: req.PaymentID, IdempotencyKey: req.IdempotencyKey})
	if errors.Is(err, payments.ErrAlreadyRefunded) {
		return nil
	}
	return err
}
