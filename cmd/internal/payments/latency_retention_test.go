package payments

import (
	"testing"
	"time"
)

// TestConfigValidateRefusesLatencyThatOutlastsKeyRetention: the gateway's
// lease is idem.DefaultLease + Latency and its keys live KeyRetention;
// idem.Middleware refuses (panics on) a lease not shorter than the TTL, so
// Validate must refuse such a Config, and NewServer must not get past
// Validate to panic inside idem.Middleware with another message.
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
	// Just under: accepted.
	if err := (Config{Latency: 24*time.Hour - 31*time.Second}).Validate(); err != nil {
		t.Errorf("Validate of a latency whose lease stays under the retention = %v", err)
	}
}
