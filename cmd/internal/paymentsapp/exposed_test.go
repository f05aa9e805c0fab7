package paymentsapp

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

// TestServeOffLoopbackNeedsAPIKey: without --api-key, an --addr that is not
// a loopback address is refused (exit 2, one line naming --api-key) before
// anything listens: any made-up sk_test_ key would charge. Before, it
// listened on every interface and took any sk_test_ key.
func TestServeOffLoopbackNeedsAPIKey(t *testing.T) {
	for _, addr := range []string{"0.0.0.0:0", ":0", "[::]:0"} {
		var stdout, stderr bytes.Buffer
		code := runCLI(context.Background(), []string{"serve", "--addr", addr}, envOf(nil), &stdout, &stderr)
		if code != 2 || !strings.Contains(stderr.String(), "--api-key") || strings.Count(strings.TrimRight(stderr.String(), "\n"), "\n") != 0 {
			t.Errorf("serve --addr %s without --api-key: exit %d, stderr %q; want 2 and one line naming --api-key", addr, code, stderr.String())
		}
	}
	for _, addr := range []string{"127.0.0.1:0", "localhost:0", "[::1]:0"} {
		if !loopbackAddr(addr) {
			t.Errorf("%s is loopback", addr)
		}
	}
	// With a key, off loopback is served.
	ctx, cancel := context.WithCancel(context.Background())
	stderr := new(syncBuffer)
	done := make(chan int, 1)
	go func() {
		done <- runCLI(ctx, []string{"serve", "--addr", "0.0.0.0:0", "--api-key", "sk_test_only"}, envOf(nil), new(bytes.Buffer), stderr)
	}()
	listening(t, stderr, done)
	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Errorf("serve with --api-key exited %d:\n%s", code, stderr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop")
	}
}
