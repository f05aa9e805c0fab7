package idem_test

// Fingerprints are stored with their keys and compared with a retry's, so
// a release that computed another fingerprint for the same request would
// answer 422 to every retry of a key stored before the upgrade. These
// values were computed by the released Fingerprint; a change to the
// hashed form must keep them.

import (
	"crypto/sha256"
	"encoding/hex"
	"net/http/httptest"
	"testing"

	"github.com/idem-go/idem"
)

func TestFingerprintPinnedValues(t *testing.T) {
	for _, c := range []struct{ method, target, body, want string }{
		{"POST", "/v1/orders", `{"items":[{"sku":"SKU-1","quantity":2,"unit_price":1299}],"currency":"EUR"}`,
			"4b05e6112be14eef91f1765baf7d86bc96ff8a72ea439a50fb3e2df10545113d"},
		{"POST", "/v1/orders", ``, "f725b696dbdb1b26b5f5fb894cdee01633d7c57b0aa6719ce7f197ac214bcd15"},
		{"PUT", "/v1/caf%C3%A9/%2E%2E", `not json`, "bf268b88edb7647fafd04e14f5b7e6d9113a8ddffa6d942731e03e96cd9f3b9b"},
		{"PATCH", "/a%2Fb", "\x00r", "22c53191f797a9526d488906f1cd33c7376e35acb937fdc451e49e61d9913928"},
		{"POST", "/", `{"b":[1,2.50,{"z":null,"a":"\u00e9"}],"a":true}`,
			"5a19297a901d2437040437c0c40ab88b9ac35f5e9b6aa7842197189c54e36983"},
		{"POST", "/v1/orders", `{}`, "7aca807edf41e7a34958cf7184a0c38e0f2aec87d555df0db79424ce98b81ea0"},
		// An empty query, or one of empty segments only, names no
		// parameter: the same request as none.
		{"POST", "/v1/orders?", `{}`, "7aca807edf41e7a34958cf7184a0c38e0f2aec87d555df0db79424ce98b81ea0"},
		{"POST", "/v1/orders?&&", `{}`, "7aca807edf41e7a34958cf7184a0c38e0f2aec87d555df0db79424ce98b81ea0"},
		{"POST", "/v1/orders?&", `{}`, "7aca807edf41e7a34958cf7184a0c38e0f2aec87d555df0db79424ce98b81ea0"},
	} {
		got, err := idem.Fingerprint(httptest.NewRequest(c.method, c.target, nil), []byte(c.body))
		if err != nil {
			t.Fatalf("Fingerprint(%s %s, %q): %v", c.method, c.target, c.body, err)
		}
		if got != c.want {
			t.Errorf("Fingerprint(%s %s, %q) = %s, want %s (as released)", c.method, c.target, c.body, got, c.want)
		}
	}
	// The hashed form the pins come from: method NUL path NUL, then 'j'
	// and the canonical JSON.
	sum := sha256.Sum256([]byte("POST\x00/v1/orders\x00j{}"))
	if got, want := hex.EncodeToString(sum[:]), "7aca807edf41e7a34958cf7184a0c38e0f2aec87d555df0db79424ce98b81ea0"; got != want {
		t.Errorf("sha256 of the hashed form = %s, want %s", got, want)
	}
}
