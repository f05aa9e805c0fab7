package ordersapp

import (
	"strings"
	"testing"
)

// TestDemoGatewayLatencyOutlastingKeyRetentionIsUsageError: `orders demo
// --gateway-latency D` with a D that makes the in-process gateway's lease
// (30s + D) not shorter than its 24h key retention is a bad flag value:
// exit 2 with one line naming --gateway-latency, not a panic.
func TestDemoGatewayLatencyOutlastingKeyRetentionIsUsageError(t *testing.T) {
	var code int
	var stderr string
	func() {
		defer func() {
			if v := recover(); v != nil {
				t.Fatalf("orders demo --gateway-latency 24h panicked: %v", v)
			}
		}()
		code, _, stderr = run(t, nil, "demo", "--gateway-latency", "24h", "--keys", "1", "--copies", "1", "--clients", "1")
	}()
	if code != 2 {
		t.Errorf("exit code = %d, want 2; stderr %q", code, stderr)
	}
	if strings.Count(stderr, "\n") != 1 || !strings.Contains(stderr, "--gateway-latency") {
		t.Errorf("stderr = %q, want one line naming --gateway-latency", stderr)
	}
}
