package orders

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash"
	"time"
)

// PaymentKey returns the idempotency key sent to the payment gateway for the
// operation that user's Idempotency-Key key names. keyCreatedAt is when the
// key's idempotency record was created (idemdriver.Record.CreatedAt): a key that
// expired and is used again starts a new operation and so must pay with
// another key. The result is 64 hex characters, the same for every attempt
// at one operation, so the gateway charges once however often the request
// runs.
func PaymentKey(user, key string, keyCreatedAt time.Time) string {
	return hex.EncodeToString(derive("idem-go/orders/payment-key/v1", user, key, keyCreatedAt))
}

// RefundKey returns the idempotency key sent to the payment gateway to
// refund the payment of the operation that user's Idempotency-Key key names
// (see PaymentKey), when its order can never be written. It is 64 hex
// characters, the same for every attempt at one operation and distinct from
// PaymentKey, so the gateway refunds once however often the request runs.
func RefundKey(user, key string, keyCreatedAt time.Time) string {
	return hex.EncodeToString(derive("idem-go/orders/refund-key/v1", user, key, keyCreatedAt))
}

// OrderID returns the id of the order that user's Idempotency-Key key
// creates ("ord_" and 24 hex characters), the same for every attempt at one
// operation; see PaymentKey.
func OrderID(user, key string, keyCreatedAt time.Time) string {
	return "ord_" + hex.EncodeToString(derive("idem-go/orders/order-id/v1", user, key, keyCreatedAt)[:12])
}

// derive hashes its fields with length prefixes, so that no two distinct
// inputs, and no two domains, encode alike.
func derive(domain, user, key string, keyCreatedAt time.Time) []byte {
	h := sha256.New()
	field(h, domain)
	field(h, user)
	field(h, key)
	var micros int64 // zero time: 0; Postgres and SQLite keep microseconds
	if !keyCreatedAt.IsZero() {
		micros = keyCreatedAt.UnixMicro()
	}
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(micros))
	h.Write(b[:])
	return h.Sum(nil)
}

func field(h hash.Hash, s string) {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(len(s)))
	h.Write(b[:])
	h.Write([]byte(s))
}

// randomPaymentKey and randomOrderID serve requests without an
// Idempotency-Key: every such request is a new operation.
func randomPaymentKey() string { return hex.EncodeToString(randomBytes(32)) }

func randomOrderID() string { return "ord_" + hex.EncodeToString(randomBytes(12)) }

func randomBytes(n int) []byte {
	b := make([]byte, n)
	rand.Read(b) // never fails (crypto/rand, Go 1.24+)
	return b
}
