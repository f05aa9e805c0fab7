package paymentsapp

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// TestServeLatencyOutlastingKeyRetentionIsUsageError: `payments serve
// --latency D` with a D that makes the gateway's lease (30s + D) not
// shorter than its 24h key retention is a bad flag value: exit 2 with a
// one-line error naming --latency, not a panic at start. The largest
// duration (2562047h) overflows 30s + D into a negative lease.
func TestServeLatencyOutlastingKeyRetentionIsUsageError(t *testing.T) {
	for _, latency := range []string{"24h", "23h59m30s", "2562047h"} {
		t.Run(latency, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			var stdout, stderr bytes.Buffer
			var code int
			func() {
				defer func() {
					if v := recover(); v != nil {
						t.Fatalf("payments serve --latency %s panicked: %v", latency, v)
					}
				}()
				code = runCLI(ctx, []string{"serve", "--addr", "127.0.0.1:0", "--latency", latency}, envOf(nil), &stdout, &stderr)
			}()
			if code != ExitUsage {
				t.Errorf("exit code = %d, want %d; stderr %q", code, ExitUsage, stderr.String())
			}
			if msg := stderr.String(); strings.Count(msg, "\n") != 1 || !strings.Contains(msg, "--latency") {
				t.Errorf("stderr = %q, want one line naming --latency", msg)
			}
		})
	}
}
