package ordersapp

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/idem-go/idem/internal/orders"
	"github.com/idem-go/idem/internal/payments"
)

// payer pays for orders through the gateway's Stripe-compatible API.
type payer struct{ c *payments.Client }

var _ orders.Payer = payer{}

// newPayer returns a payer for the gateway at c.PaymentsURL or, when it is
// empty, for an in-process gateway (the same handler behind an in-memory
// transport, no socket) that keeps its state in be's database. The ledger
// is the in-process gateway's, nil for an external one.
func newPayer(ctx context.Context, c *Config, be *backend) (payer, payments.Ledger, error) {
	cfg := payments.ClientConfig{BaseURL: c.PaymentsURL, APIKey: c.PaymentsKey, MaxNetworkRetries: 3}
	if c.PaymentsURL != "" {
		cfg.HTTPClient = &http.Client{}
		return payer{payments.NewClient(cfg)}, nil, nil
	}
	store, ledger, err := be.gateway(ctx)
	if err != nil {
		return payer{}, nil, err
	}
	gw := payments.NewServer(payments.Config{APIKey: c.PaymentsKey, Store: store, Ledger: ledger, Latency: c.gatewayLatency})
	cfg.BaseURL = payments.InProcessURL
	cfg.HTTPClient = payments.InProcess(gw)
	return payer{payments.NewClient(cfg)}, ledger, nil
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
