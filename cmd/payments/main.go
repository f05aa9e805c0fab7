// Command payments runs a payment gateway that speaks a Stripe-compatible
// subset of the PaymentIntents and Refunds APIs, with fault injection for
// tests.
//
//	payments serve [--addr 127.0.0.1:8081] [--database-url URL] [--api-key KEY]
//	               [--latency D] [--fail-after-charge F] [--decline-over AMOUNT]
//
// The gateway keeps its idempotency keys and PaymentIntents in memory
// unless --database-url names a PostgreSQL database (postgres://…, in the
// schema that the URL's search_path names) or a SQLite file (sqlite:PATH),
// where they survive a restart. Idempotency keys are kept for 24 hours, as
// at Stripe, and a background cleaner deletes expired ones.
//
// Run 'payments serve --help' for every flag and its environment variable.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/idem-go/idem/cmd/internal/paymentsapp"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := paymentsapp.Main(ctx)
	stop()
	os.Exit(code)
}
