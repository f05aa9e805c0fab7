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
// # Orders the database refuses
//
// The handler validates everything the database would refuse before it
// pays (see the limits in order.go). For a refusal no validation foresees,
// the repositories return [ErrUnwritable] (PostgreSQL's SQLSTATE classes 22
// and 23 other than the order's own unique keys, SQLite's constraint,
// too-big and mismatch errors), having written in a savepoint of the
// request's transaction so that it can still commit. The handler then
// refunds the payment in full through [Payer.Refund] with a key derived
// like the payment's ([RefundKey]) and answers a final 422
// [ProblemOrderNotWritable], which [StoredStatus] stores; a refund that
// fails is answered 502 and not stored, so a retry or the completer refunds
// with the same key.
//
// # Errors
//
// Every error answer is application/problem+json (RFC 9457). [ProblemTypes]
// lists the type URIs this service emits, the middleware's included.
package orders
