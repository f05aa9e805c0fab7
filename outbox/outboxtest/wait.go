package outboxtest

import (
	"runtime"
	"testing"

	"github.com/idem-go/idem/internal/testwait"
)

// runtimeGosched yields the processor, to let other relays run.
func runtimeGosched() { runtime.Gosched() }

// waitUntil polls cond (see testwait.Until) with the default timeout.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testwait.Until(t, 0, what, cond)
}
