package ratelimit

import (
	"testing"
	"time"
)

// TestKeyed: burst at once per key, then one per every; keys do not share
// buckets; a refusal says how long to wait; full buckets are forgotten.
func TestKeyed(t *testing.T) {
	l := New(time.Second, 3)
	now := time.Unix(1_000_000, 0)
	for i := range 3 {
		if _, ok := l.Allow("a", now); !ok {
			t.Fatalf("a's request %d refused within the burst", i+1)
		}
	}
	wait, ok := l.Allow("a", now)
	if ok || wait <= 0 || wait > time.Second {
		t.Fatalf("a past the burst: ok %v wait %v, want refused, wait ≤ 1s", ok, wait)
	}
	if RetryAfter(wait) != 1 || RetryAfter(0) != 1 || RetryAfter(1500*time.Millisecond) != 2 {
		t.Errorf("RetryAfter: %d %d %d", RetryAfter(wait), RetryAfter(0), RetryAfter(1500*time.Millisecond))
	}
	if _, ok := l.Allow("b", now); !ok {
		t.Fatal("b refused: buckets are per key")
	}
	if _, ok := l.Allow("a", now.Add(time.Second)); !ok {
		t.Fatal("a refused after one period")
	}
	l.Allow("c", now.Add(time.Hour))
	if n := l.Len(); n != 1 {
		t.Errorf("%d buckets after an hour, want 1", n)
	}
}
