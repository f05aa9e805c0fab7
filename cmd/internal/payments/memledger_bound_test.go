package payments

import (
	"encoding/json"
	"net/http"
	"testing"
)

// TestMemLedgerBounded: a gateway in memory keeps at most MaxIntents
// PaymentIntents: past it a charge is refused with 503 (nothing charged,
// the key not kept, so a retry may succeed once there is room) instead of
// growing without end; a replay of a charge made before still answers.
func TestMemLedgerBounded(t *testing.T) {
	ledger := &MemLedger{MaxIntents: 2}
	srv, _ := setup(t, Config{Ledger: ledger})
	c := srv.Client()
	u := srv.URL + "/v1/payment_intents"
	for i, key := range []string{"k1", "k2"} {
		if r := do(t, c, "POST", u, "sk_test_x", key, chargeForm(int64(100+i), "pm_card_visa").Encode()); r.status != http.StatusOK {
			t.Fatalf("charge %s: %d %s", key, r.status, r.body)
		}
	}
	r := do(t, c, "POST", u, "sk_test_x", "k3", chargeForm(300, "pm_card_visa").Encode())
	if r.status != http.StatusServiceUnavailable {
		t.Fatalf("charge past the bound: %d %s, want 503", r.status, r.body)
	}
	var e struct {
		Error PaymentError `json:"error"`
	}
	if err := json.Unmarshal(r.body, &e); err != nil || e.Error.Type != "api_error" {
		t.Errorf("the 503's body: %s (%v), want a Stripe api_error", r.body, err)
	}
	if n := ledger.Len(); n != 2 {
		t.Errorf("the ledger holds %d PaymentIntents, want 2", n)
	}
	if r := do(t, c, "POST", u, "sk_test_x", "k1", chargeForm(100, "pm_card_visa").Encode()); r.status != http.StatusOK || r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("replay of k1 past the bound: %d replayed=%q", r.status, r.header.Get("Idempotent-Replayed"))
	}
}
