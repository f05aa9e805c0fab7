package payments

import (
	"testing"
	"time"
)

// TestConfigValidateRefusesLatencyThatOutlastsKeyRetention: the gateway's
// lease is idem.DefaultLease + Latency, at most half of KeyRetention (the
// keys' TTL: idem.Middleware refuses a lease not shorter than it), and
// must outlast the injected latency; so Validate refuses a Latency of half
// the retention or more, and NewServer never gets past Validate to panic
// inside idem.Middleware with another message.
func TestConfigValidateRefusesLatencyThatOutlastsKeyRetention(t *testing.T) {
	for _, c := range []Config{
		{Latency: DefaultKeyRetention},                       // default retention
		{Latency: 24*time.Hour - 30*time.Second},             // lease exactly equals the TTL
		{Latency: time.Hour, KeyRetention: 30 * time.Minute}, // explicit retention
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("Validate(Latency %v, KeyRetention %v) = nil, want an error: the lease %v would not be shorter than the keys' retention",
				c.Latency, c.KeyRetention, 30*time.Second+c.Latency)
		}
	}
	// Just under half the retention (the lease's bound): accepted.
	if err := (Config{Latency: 12*time.Hour - time.Second}).Validate(); err != nil {
		t.Errorf("Validate of a latency whose lease stays under the retention = %v", err)
	}
}
