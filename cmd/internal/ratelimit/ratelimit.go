// Package ratelimit keeps a token bucket per key (a client address, a
// user), in memory, forgetting the buckets of keys not seen lately.
package ratelimit

import (
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// sweepEvery is how often buckets that have filled up again (their key
// has not asked for a while) are forgotten, so that the map holds only the
// keys seen lately.
const sweepEvery = time.Minute

// Keyed is a token bucket per key: burst requests at once, then one per
// every. It is safe for concurrent use.
type Keyed struct {
	every time.Duration
	burst int

	mu        sync.Mutex
	buckets   map[string]*rate.Limiter
	lastSweep time.Time
}

// New returns a Keyed whose buckets hold burst tokens and gain one per
// every.
func New(every time.Duration, burst int) *Keyed {
	return &Keyed{every: every, burst: burst, buckets: make(map[string]*rate.Limiter)}
}

// Allow takes one token of key's bucket at now and reports true, or
// reports false and how long until the bucket has one.
func (l *Keyed) Allow(key string, now time.Time) (time.Duration, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Sub(l.lastSweep) >= sweepEvery {
		for k, b := range l.buckets {
			if b.TokensAt(now) >= float64(l.burst) {
				delete(l.buckets, k)
			}
		}
		l.lastSweep = now
	}
	b, ok := l.buckets[key]
	if !ok {
		b = rate.NewLimiter(rate.Every(l.every), l.burst)
		l.buckets[key] = b
	}
	if b.AllowN(now, 1) {
		return 0, true
	}
	r := b.ReserveN(now, 1)
	wait := r.DelayFrom(now)
	r.CancelAt(now)
	return wait, false
}

// Len returns how many buckets l keeps: one per key seen lately.
func (l *Keyed) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.buckets)
}

// RetryAfter is wait as a Retry-After value: whole seconds, at least 1.
func RetryAfter(wait time.Duration) int {
	return max(1, int((wait+time.Second-1)/time.Second))
}
