package checkout

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/idem-go/idem/internal/orders"
)

var testSecret = []byte("checkout-test-secret-0123456789abcdef")

func serve(t *testing.T, h http.Handler, method, path string) *httptest.ResponseRecorder {
	t.Helper()
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest(method, path, nil))
	return w
}

// TestChkFiles: the page and its files with their content types, HEAD
// without a body, and the page's Content-Security-Policy.
func TestChkFiles(t *testing.T) {
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

// TestChkErrors: unknown files and wrong methods are problem+json.
func TestChkErrors(t *testing.T) {
	h := Handler(Options{Secret: testSecret})
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

// TestChkSession: POST /checkout/session signs in a new guest each time
// with a token for it, valid for TokenTTL from Options.Now. (That the API
// accepts it is TestChkSessionTokenAccepted in internal/ordersapp.)
func TestChkSession(t *testing.T) {
	now := time.Now().Add(-10 * time.Minute).Truncate(time.Second)
	h := Handler(Options{Secret: testSecret, Now: func() time.Time { return now }})
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
		var claims jwt.RegisteredClaims
		if _, err := jwt.ParseWithClaims(s.Token, &claims, func(*jwt.Token) (any, error) { return testSecret, nil },
			jwt.WithValidMethods([]string{"HS256"}), jwt.WithExpirationRequired()); err != nil {
			t.Fatalf("token: %v", err)
		}
		if claims.Subject != s.UserID || !claims.ExpiresAt.Time.Equal(now.Add(TokenTTL)) {
			t.Errorf("token sub %q exp %v; want %q, %v", claims.Subject, claims.ExpiresAt.Time, s.UserID, now.Add(TokenTTL))
		}
	}
}
