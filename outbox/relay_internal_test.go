package outbox

import (
	"testing"
	"time"
)

func TestRelayBackoff(t *testing.T) {
	r := NewRelay(nil, nil, RelayOptions{Interval: time.Second, MaxBackoff: 10 * time.Second})
	for n, want := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 4: 8 * time.Second, 5: 10 * time.Second, 60: 10 * time.Second} {
		if got := r.backoff(n); got != want {
			t.Errorf("backoff(%d) = %v, want %v", n, got, want)
		}
	}
	// A MaxBackoff below Interval is raised to it.
	r = NewRelay(nil, nil, RelayOptions{Interval: time.Minute, MaxBackoff: time.Second})
	if got := r.backoff(3); got != time.Minute {
		t.Errorf("backoff with MaxBackoff < Interval = %v, want the interval", got)
	}
}
