package checkout

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/idem-go/idem/cmd/internal/orders"
)

var testSecret = []byte("checkout-test-secret-0123456789abcdef")

func serve(t *testing.T, h http.Handler, method, path string) *httptest.ResponseRecorder {
	t.Helper()
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(method, path, nil))
	return w
}

// TestCheckoutFiles: the page and its files with their content types, HEAD
// without a body, and the page's Content-Security-Policy.
func TestCheckoutFiles(t *testing.T) {
	h := Handler(Options{Secret: testSecret})
	for _, c := range []struct{ path, ct, has string }{
		{"/", "text/html; charset=utf-8", `<script src="/checkout/app.js"`},
		{"/checkout/app.js", "text/javascript; charset=utf-8", "crypto.randomUUID()"},
		{"/checkout/style.css", "text/css; charset=utf-8", "button"},
	} {
		w := serve(t, h, http.MethodGet, c.path)
		if w.Code != http.StatusOK || w.Header().Get("Content-Type") != c.ct || !strings.Contains(w.Body.String(), c.has) {
			t.Errorf("GET %s: %d %q, body has %q: %v; want 200 %q", c.path, w.Code, w.Header().Get("Content-Type"), c.has, strings.Contains(w.Body.String(), c.has), c.ct)
		}
		if w.Header().Get("X-Content-Type-Options") != "nosniff" {
			t.Errorf("GET %s: X-Content-Type-Options %q", c.path, w.Header().Get("X-Content-Type-Options"))
		}
		head := serve(t, h, http.MethodHead, c.path)
		if head.Code != http.StatusOK || head.Body.Len() != 0 || head.Header().Get("Content-Length") != w.Header().Get("Content-Length") {
			t.Errorf("HEAD %s: %d, %d body bytes, Content-Length %q; want 200, none, %q", c.path, head.Code, head.Body.Len(), head.Header().Get("Content-Length"), w.Header().Get("Content-Length"))
		}
	}
	csp := serve(t, h, http.MethodGet, "/").Header().Get("Content-Security-Policy")
	if !strings.Contains(csp, "default-src 'none'") || !strings.Contains(csp, "script-src 'self'") || !strings.Contains(csp, "connect-src 'self'") {
		t.Errorf("Content-Security-Policy %q", csp)
	}
	// The page loads nothing from elsewhere.
	for _, p := range []string{"/", "/checkout/app.js", "/checkout/style.css"} {
		if b := serve(t, h, http.MethodGet, p).Body.String(); strings.Contains(b, "http://") || strings.Contains(b, "https://") || strings.Contains(b, "//cdn") {
			t.Errorf("%s refers to another site", p)
		}
	}
}

func checkProblem(t *testing.T, w *httptest.ResponseRecorder, status int, typ string) {
	t.Helper()
	var p struct {
		Type, Title, Detail string
		Status              int
	}
	if w.Code != status || w.Header().Get("Content-Type") != "application/problem+json" {
		t.Fatalf("%d %q %s; want %d application/problem+json", w.Code, w.Header().Get("Content-Type"), w.Body, status)
	}
	if err := json.Unmarshal(w.Body.Bytes(), &p); err != nil || p.Type != typ || p.Status != status || p.Title == "" || p.Detail == "" {
		t.Errorf("problem %s (%v); want type %s, status %d, a title and a detail", w.Body, err, typ, status)
	}
}

// TestCheckoutErrors: unknown files and wrong methods are problem+json.
func TestCheckoutErrors(t *testing.T) {
	h := Handler(Options{Secret: testSecret, Guest: true})
	for _, p := range []string{"/checkout/", "/checkout/nope.js", "/checkout/index.html", "/checkout/static/app.js", "/checkout/../checkout/app.js"} {
		t.Run("404 "+p, func(t *testing.T) {
			checkProblem(t, serve(t, h, http.MethodGet, p), http.StatusNotFound, orders.ProblemNotFound)
		})
	}
	for _, c := range []struct{ method, path, allow string }{
		{http.MethodPost, "/", "GET, HEAD"},
		{http.MethodDelete, "/checkout/app.js", "GET, HEAD"},
		{http.MethodGet, "/checkout/session", "POST"},
		{http.MethodPut, "/checkout/session", "POST"},
	} {
		t.Run("405 "+c.method+" "+c.path, func(t *testing.T) {
			w := serve(t, h, c.method, c.path)
			checkProblem(t, w, http.StatusMethodNotAllowed, orders.ProblemMethodNotAllowed)
			if got := w.Header().Get("Allow"); got != c.allow {
				t.Errorf("Allow %q, want %q", got, c.allow)
			}
		})
	}
}

// TestCheckoutSession: with Options.Guest, POST /checkout/session signs in a
// new guest each time with a guest token for it (scope guest), valid for
// TokenTTL (15 minutes) from Options.Now. (That the API accepts it is
// TestCheckoutSessionTokenAccepted in cmd/internal/ordersapp.)
func TestCheckoutSession(t *testing.T) {
	now := time.Now().Add(-10 * time.Minute).Truncate(time.Second)
	h := Handler(Options{Secret: testSecret, Now: func() time.Time { return now }, Guest: true})
	if TokenTTL != 15*time.Minute {
		t.Errorf("TokenTTL %v, want 15m", TokenTTL)
	}
	seen := map[string]bool{}
	for range 2 {
		w := serve(t, h, http.MethodPost, "/checkout/session")
		if w.Code != http.StatusCreated || w.Header().Get("Content-Type") != "application/json" || w.Header().Get("Cache-Control") != "no-store" {
			t.Fatalf("%d %q (Cache-Control %q) %s", w.Code, w.Header().Get("Content-Type"), w.Header().Get("Cache-Control"), w.Body)
		}
		var s Session
		if err := json.Unmarshal(w.Body.Bytes(), &s); err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(s.UserID, "guest-") || len(s.UserID) != len("guest-")+32 || seen[s.UserID] {
			t.Errorf("user %q: want a new guest-<32 hex digits>", s.UserID)
		}
		seen[s.UserID] = true
		if s.TokenType != "Bearer" || !s.ExpiresAt.Equal(now.Add(TokenTTL)) {
			t.Errorf("token type %q, expires %v; want Bearer, %v", s.TokenType, s.ExpiresAt, now.Add(TokenTTL))
		}
		var claims struct {
			jwt.RegisteredClaims
			Scope string `json:"scope"`
		}
		if _, err := jwt.ParseWithClaims(s.Token, &claims, func(*jwt.Token) (any, error) { return testSecret, nil },
			jwt.WithValidMethods([]string{"HS256"}), jwt.WithExpirationRequired(), jwt.WithTimeFunc(func() time.Time { return now })); err != nil {
			t.Fatalf("token: %v", err)
		}
		if claims.Scope != orders.GuestScope || claims.Issuer != orders.TokenIssuer {
			t.Errorf("token scope %q iss %q; want %q, %q", claims.Scope, claims.Issuer, orders.GuestScope, orders.TokenIssuer)
		}
		if claims.Subject != s.UserID || !claims.ExpiresAt.Time.Equal(now.Add(TokenTTL)) {
			t.Errorf("token sub %q exp %v; want %q, %v", claims.Subject, claims.ExpiresAt.Time, s.UserID, now.Add(TokenTTL))
		}
	}
}

// TestCheckoutGuestOff: without Options.Guest, POST /checkout/session is an
// unknown route (404 problem+json, whatever the method), and the page
// says that guest checkout is off and how to get a token, with its
// sign-in section shown; with it, the section is hidden.
func TestCheckoutGuestOff(t *testing.T) {
	h := Handler(Options{Secret: testSecret})
	for _, m := range []string{http.MethodPost, http.MethodGet} {
		checkProblem(t, serve(t, h, m, "/checkout/session"), http.StatusNotFound, orders.ProblemNotFound)
	}
	page := serve(t, h, http.MethodGet, "/")
	body := page.Body.String()
	if page.Code != http.StatusOK || page.Header().Get("Content-Length") != strconv.Itoa(len(body)) {
		t.Fatalf("GET /: %d, Content-Length %q for %d bytes", page.Code, page.Header().Get("Content-Length"), len(body))
	}
	for _, want := range []string{`data-guest-checkout="off"`, `<section id="signin" aria-labelledby="signin-h">`,
		"Guest checkout is off on this server", "orders token --user ID", `id="token-input"`} {
		if !strings.Contains(body, want) {
			t.Errorf("the page without guest checkout lacks %q", want)
		}
	}
	on := serve(t, Handler(Options{Secret: testSecret, Guest: true}), http.MethodGet, "/").Body.String()
	if !strings.Contains(on, `data-guest-checkout="on"`) || !strings.Contains(on, `<section id="signin" aria-labelledby="signin-h" hidden>`) {
		t.Error("the page with guest checkout does not say it is on, or shows its sign-in section")
	}
}

// TestCheckoutSessionRateLimit: POST /checkout/session takes SessionBurst
// sign-ins at once from one address, then answers 429 problem+json with
// Retry-After until SessionEvery has passed; other addresses have buckets
// of their own, and the addresses of one IPv6 /64 share one.
func TestCheckoutSessionRateLimit(t *testing.T) {
	now := time.Now()
	h := Handler(Options{Secret: testSecret, Now: func() time.Time { return now }, Guest: true})
	post := func(addr string) *httptest.ResponseRecorder {
		w := httptest.NewRecorder()
		r := httptest.NewRequest(http.MethodPost, "/checkout/session", nil)
		r.RemoteAddr = addr
		h.ServeHTTP(w, r)
		return w
	}
	for i := range SessionBurst {
		if w := post("192.0.2.1:1000"); w.Code != http.StatusCreated {
			t.Fatalf("sign-in %d: %d %s", i+1, w.Code, w.Body)
		}
	}
	w := post("192.0.2.1:2000")
	checkProblem(t, w, http.StatusTooManyRequests, orders.ProblemRateLimited)
	if got := w.Header().Get("Retry-After"); got != "6" {
		t.Errorf("Retry-After %q, want 6", got)
	}
	if w := post("192.0.2.2:1000"); w.Code != http.StatusCreated {
		t.Errorf("another address: %d, want 201", w.Code)
	}
	now = now.Add(SessionEvery)
	if w := post("192.0.2.1:1000"); w.Code != http.StatusCreated {
		t.Errorf("after %v: %d, want 201", SessionEvery, w.Code)
	}
	checkProblem(t, post("192.0.2.1:1000"), http.StatusTooManyRequests, orders.ProblemRateLimited)

	for i := range SessionBurst {
		if w := post(fmt.Sprintf("[2001:db8:1:2::%x]:443", i+1)); w.Code != http.StatusCreated {
			t.Fatalf("IPv6 sign-in %d: %d", i+1, w.Code)
		}
	}
	checkProblem(t, post("[2001:db8:1:2:ffff::1]:443"), http.StatusTooManyRequests, orders.ProblemRateLimited)
	if w := post("[2001:db8:1:3::1]:443"); w.Code != http.StatusCreated {
		t.Errorf("another /64: %d, want 201", w.Code)
	}

	// Buckets that filled up again are forgotten.
	now = now.Add(time.Hour)
	post("198.51.100.1:1")
	if n := h.(*handler).limiter.Len(); n != 1 {
		t.Errorf("%d buckets kept after an hour, want 1 (the last address's)", n)
	}
}
