// Package orders is the reference order service: an order domain, its
// SQLite repository and its HTTP API, made idempotent with the idem
// middleware.
//
// # Creating an order
//
// POST /v1/orders runs behind bearer-token authentication and
// [idem.Middleware]. The handler validates the body, pays through a [Payer]
// with a payment key derived from the user's Idempotency-Key ([PaymentKey]),
// and writes the order through the idempotent request's transaction, so the
// order and the stored response commit together. The order id is derived
// from the key as well ([OrderID]): a request that is run again (after a 5xx,
// a crash, or by the completer) pays with the same key, which the gateway
// deduplicates, and writes the same order id, which the database
// deduplicates.
//
// # Errors
//
// Every error answer is application/problem+json (RFC 9457). [ProblemTypes]
// lists the type URIs this service emits, the middleware's included.
package orders
