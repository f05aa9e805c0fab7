// Package testwait lets a test wait for a condition it cannot be signalled
// about: it polls the condition and stops as soon as it holds, or fails the
// test when a deadline passes.
package testwait

import (
	"testing"
	"time"
)

// DefaultTimeout is how long Until waits when given a timeout of 0: far
// longer than any condition should take, even under -race on a busy
// machine.
const DefaultTimeout = 10 * time.Second

// Until calls cond every millisecond until it returns true, and fails t
// with what (the condition awaited) if it has not after timeout (0:
// DefaultTimeout). It must be called from the test's goroutine; cond runs
// on it too, so it may call t.Fatal.
func Until(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", timeout, what)
		}
		time.Sleep(time.Millisecond)
	}
}
