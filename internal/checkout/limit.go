package checkout

import (
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// clientLimiter is a token bucket per client address.
type clientLimiter struct {
	every time.Duration
	burst int

	mu        sync.Mutex
	buckets   map[string]*rate.Limiter
	lastSweep time.Time
}

// limiterSweep is how often buckets that have filled up again (their
// client has not asked for a while) are forgotten, so that the map holds
// only the addresses seen lately.
const limiterSweep = time.Minute

func newClientLimiter(every time.Duration, burst int) *clientLimiter {
	return &clientLimiter{every: every, burst: burst, buckets: make(map[string]*rate.Limiter)}
}

// allow takes one token of client's bucket at now and reports true, or
// reports false and how long until the bucket has one.
func (l *clientLimiter) allow(client string, now time.Time) (time.Duration, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Sub(l.lastSweep) >= limiterSweep {
		for c, b := range l.buckets {
			if b.TokensAt(now) >= float64(l.burst) {
				delete(l.buckets, c)
			}
		}
		l.lastSweep = now
	}
	b, ok := l.buckets[client]
	if !ok {
		b = rate.NewLimiter(rate.Every(l.every), l.burst)
		l.buckets[client] = b
	}
	if b.AllowN(now, 1) {
		return 0, true
	}
	r := b.ReserveN(now, 1)
	wait := r.DelayFrom(now)
	r.CancelAt(now)
	return wait, false
}

// clientAddress is the key of r's client for the rate limit: the peer's
// IP address (X-Forwarded-For and the like are not trusted: behind a
// proxy every client shares the proxy's bucket), an IPv6 address reduced
// to its /64 prefix, which one host usually has whole.
func clientAddress(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	a, err := netip.ParseAddr(host)
	if err != nil {
		return host
	}
	a = a.Unmap()
	if a.Is6() {
		p, _ := a.Prefix(64)
		return p.String()
	}
	return a.String()
}
