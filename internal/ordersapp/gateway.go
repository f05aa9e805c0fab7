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

// newPayer returns a payer for the gateway at c.PaymentsURL, or for an
// in-process gateway (the same handler, no socket) when it is empty.
func newPayer(c *Config) (payer, *payments.Server) {
	cfg := payments.ClientConfig{BaseURL: c.PaymentsURL, APIKey: c.PaymentsKey, MaxNetworkRetries: 3}
	var gw *payments.Server
	if c.PaymentsURL == "" {
		gw = payments.NewServer(payments.Config{APIKey: c.PaymentsKey, Latency: c.gatewayLatency})
		cfg.BaseURL = "http://payments.in-process"
		cfg.HTTPClient = payments.InProcess(gw)
	} else {
		cfg.HTTPClient = &http.Client{}
	}
	return payer{payments.NewClient(cfg)}, gw
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
