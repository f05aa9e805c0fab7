package orders

import (
	"net/http"

	"github.com/idem-go/idem/problem"
)

// Problem type URIs of the order API. They are stable: clients may switch
// on them.
const (
	ProblemInvalidRequest   = problem.Base + "invalid-request"
	ProblemUnauthorized     = problem.Base + "unauthorized"
	ProblemNotFound         = problem.Base + "not-found"
	ProblemMethodNotAllowed = problem.Base + "method-not-allowed"
	ProblemPaymentDeclined  = problem.Base + "payment-declined"
	ProblemPaymentGateway   = problem.Base + "payment-gateway-error"
	ProblemOrderConflict    = problem.Base + "order-conflict"
	ProblemUnavailable      = problem.Base + "unavailable"
	ProblemOrderNotWritable = problem.Base + "order-not-writable"
	// ProblemUnsupportedMediaType: POST /v1/orders with a Content-Type
	// other than application/json (415).
	ProblemUnsupportedMediaType = problem.Base + "unsupported-media-type"
	// ProblemGuestOrderLimit: a guest token's user has made
	// Config.GuestOrderLimit orders already (403).
	ProblemGuestOrderLimit = problem.Base + "guest-order-limit"
	// ProblemRateLimited: POST /checkout/session asked for too often from
	// one client address, or POST /v1/orders by one user (429, with
	// Retry-After).
	ProblemRateLimited = problem.Base + "rate-limited"
	// ProblemTooManyKeys: the user holds Config.MaxLiveKeys unexpired
	// idempotency keys (429, with Retry-After).
	ProblemTooManyKeys = problem.Base + "too-many-keys"
)

// ProblemType documents one problem type URI.
type ProblemType struct {
	Type   string
	Status int
	Title  string
	// Meaning says when it is answered and what a client should do.
	Meaning string
}

// ProblemTypes lists every problem type the order service answers with, the
// idempotency middleware's included, in the order the README shows them.
var ProblemTypes = []ProblemType{
	{ProblemInvalidRequest, http.StatusBadRequest, "Invalid request",
		"The body or query is invalid (bad JSON or UTF-8, unknown field, trailing data, a member name repeated in one object exactly or differing only in case, no items or more than 100, a sku that is blank, over 64 characters or holds a control character, quantity outside 1..1000, unit_price <= 0, currency not an active ISO 4217 code in capitals, total over 99,999,999, limit outside 1..100, unknown starting_after). Nothing happened; fix the request (the same Idempotency-Key may be reused)."},
	{problem.KeyMissing, http.StatusBadRequest, "Idempotency-Key required",
		"POST /v1/orders without an Idempotency-Key while keys are required."},
	{problem.KeyInvalid, http.StatusBadRequest, "Invalid Idempotency-Key",
		"The Idempotency-Key is not 1-255 visible ASCII characters, bare or as an RFC 8941 sf-string, or was sent twice."},
	{ProblemUnauthorized, http.StatusUnauthorized, "Unauthorized",
		"The bearer token is missing, malformed, expired, without exp, with a sub that is empty or over 255 bytes, not HS256, or badly signed. Comes with WWW-Authenticate: Bearer."},
	{ProblemGuestOrderLimit, http.StatusForbidden, "Guest order limit reached",
		"The bearer token is a guest token (from POST /checkout/session) and its guest user has made as many orders as a guest may (10). Checked before the payment: nothing was charged or stored, and the key stays free. Sign in with a token from orders token, or as a new guest."},
	{ProblemPaymentDeclined, http.StatusPaymentRequired, "Payment declined",
		"The gateway declined the payment; no order was made. A final outcome: it is stored and replayed for the same key, so retry with a new key."},
	{ProblemNotFound, http.StatusNotFound, "Not found",
		"No such route, or no such order among the caller's own."},
	{ProblemMethodNotAllowed, http.StatusMethodNotAllowed, "Method not allowed",
		"The route exists but not with this method; the Allow header lists the methods it takes."},
	{problem.InFlight, http.StatusConflict, "Request with this Idempotency-Key in flight",
		"Another request with the same key is still running. Retry with the same key after Retry-After seconds."},
	{ProblemOrderConflict, http.StatusConflict, "Order already exists",
		"The order this key names was already created by another attempt. Retry with the same key to get its answer."},
	{problem.RequestTooLarge, http.StatusRequestEntityTooLarge, "Request body too large",
		"The body is over 1 MiB."},
	{ProblemUnsupportedMediaType, http.StatusUnsupportedMediaType, "Unsupported media type",
		"POST /v1/orders with a Content-Type other than application/json (parameters allowed; a request without one is read as JSON). Refused before the key is claimed or anyone is charged; Accept-Post names the type it takes."},
	{problem.KeyMismatch, http.StatusUnprocessableEntity, "Idempotency-Key reused with a different request",
		"The key was first used with another method, path or body. The handler did not run; use a new key."},
	{ProblemOrderNotWritable, http.StatusUnprocessableEntity, "Order could not be written",
		"The payment succeeded but the database refuses the order for good, so the payment (payment_id) was refunded in full with a key derived from the Idempotency-Key, and no order exists. A final outcome: it is stored and replayed for the same key, so use a new key to try again. If the refund fails the answer is 502 instead, and a retry with the same key refunds once."},
	{ProblemRateLimited, http.StatusTooManyRequests, "Too many requests",
		"POST /checkout/session was asked for too often from this client address (10 at once, then one every 6 seconds), or POST /v1/orders by this user (2,000 at once, then 1,000 a second, per instance). Nothing was claimed or charged. Retry after Retry-After seconds (with the same Idempotency-Key)."},
	{ProblemTooManyKeys, http.StatusTooManyRequests, "Too many idempotency keys",
		"The user holds 1,000,000 unexpired Idempotency-Keys (each kept for the key TTL), the most one user may. Refused before the payment: nothing was charged or stored. Retry after Retry-After seconds, when the oldest expires."},
	{problem.Internal, http.StatusInternalServerError, "Internal Server Error",
		"An unexpected failure. Nothing was stored; retry with the same key."},
	{ProblemPaymentGateway, http.StatusBadGateway, "Payment gateway error",
		"The payment gateway failed or could not be reached. Nothing was stored; retry with the same key, which pays with the same gateway key and so never charges twice."},
	{ProblemUnavailable, http.StatusServiceUnavailable, "Service unavailable",
		"The database did not answer (also GET /healthz). Retry after Retry-After seconds."},
	{problem.StoreUnavailable, http.StatusServiceUnavailable, "Idempotency store unavailable",
		"The idempotency store failed; the request was not run or not committed. Retry with the same key."},
}

func newProblem(typ string, status int, title, detail string) problem.Details {
	return problem.Details{Type: typ, Title: title, Status: status, Detail: detail}
}

func writeProblem(w http.ResponseWriter, p problem.Details) { problem.Write(w, p) }
