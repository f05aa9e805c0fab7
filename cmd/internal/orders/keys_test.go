package orders

import (
	"regexp"
	"testing"
	"time"
)

func TestDerivedKeys(t *testing.T) {
	at := time.Date(2025, 3, 1, 12, 0, 0, 123456789, time.UTC)
	pk := PaymentKey("alice", "k", at)
	if !regexp.MustCompile(`^[0-9a-f]{64}$`).MatchString(pk) {
		t.Errorf("PaymentKey = %q, want 64 hex characters", pk)
	}
	id := OrderID("alice", "k", at)
	if !regexp.MustCompile(`^ord_[0-9a-f]{24}$`).MatchString(id) {
		t.Errorf("OrderID = %q, want ord_ and 24 hex characters", id)
	}
	// Deterministic, and blind to the time zone and to nanoseconds that a
	// database may not keep.
	if got := PaymentKey("alice", "k", at.In(time.FixedZone("X", 3600)).Truncate(time.Microsecond)); got != pk {
		t.Errorf("PaymentKey differs for the same instant: %q, %q", got, pk)
	}
	if got := OrderID("alice", "k", at); got != id {
		t.Errorf("OrderID not deterministic: %q, %q", got, id)
	}
	// Every input matters, and fields cannot run into each other.
	for _, c := range []struct {
		user, key string
		at        time.Time
	}{
		{"bob", "k", at},
		{"alice", "k2", at},
		{"alice", "k", at.Add(time.Microsecond)},
		{"alicek", "", at},
		{"alic", "ek", at},
		{"alice", "k", time.Time{}},
	} {
		if got := PaymentKey(c.user, c.key, c.at); got == pk {
			t.Errorf("PaymentKey(%q, %q, %v) = PaymentKey(alice, k)", c.user, c.key, c.at)
		}
		if got := OrderID(c.user, c.key, c.at); got == id {
			t.Errorf("OrderID(%q, %q, %v) = OrderID(alice, k)", c.user, c.key, c.at)
		}
	}
	// The two derivations are separated: the order id is not a prefix of
	// the payment key.
	if id[4:] == pk[:24] {
		t.Error("OrderID and PaymentKey share their hash")
	}
	if o1, o2, p1, p2 := randomOrderID(), randomOrderID(), randomPaymentKey(), randomPaymentKey(); o1 == o2 || p1 == p2 {
		t.Error("random ids repeat")
	}
}
