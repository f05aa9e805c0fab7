// Package payments is a payment gateway that speaks a Stripe-compatible
// subset of the PaymentIntents API, and the client the order service pays
// through.
//
// # Server
//
// [NewServer] returns an http.Handler for POST, GET and list on
// /v1/payment_intents, close enough to Stripe that the official stripe-go
// client works against it unchanged. Creating a PaymentIntent is made
// idempotent by this module's own middleware ([idem.Middleware]): the
// PaymentIntent is written to the [Ledger] in the same transaction as the
// stored response, so a PaymentIntent exists exactly when its idempotent
// outcome committed. Faults can be injected for tests: latency before each
// charge, dropped connections after a committed charge, and declines above
// an amount.
//
// # Client
//
// [Client] wraps stripe-go: [Client.Charge] creates and confirms a
// PaymentIntent with the caller's idempotency key, and stripe-go retries
// network errors and lock timeouts with that key. [InProcess] serves a
// Client's requests from a handler in the same process, without a socket.
//
// # Command
//
// [RunCLI] is the `payments` command: `payments serve` runs the gateway.
package payments
