package checkout

import (
	"net"
	"net/http"
	"net/netip"
)

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
