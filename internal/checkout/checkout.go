// Package checkout serves the checkout page of the order service: GET /
// and its files under /checkout/.
package checkout

import (
	"embed"
	"net/http"
	"time"
)

//go:embed static
var static embed.FS

// Options configures Handler.
type Options struct {
	// Secret signs the demo user's bearer token.
	Secret []byte
	// Now is the clock for the token's expiry. Default time.Now.
	Now func() time.Time
}

// Handler serves GET / (the page) and the page's files under /checkout/.
func Handler(o Options) http.Handler {
	page, err := static.ReadFile("static/index.html")
	if err != nil {
		panic(err)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Write(page)
	})
}
