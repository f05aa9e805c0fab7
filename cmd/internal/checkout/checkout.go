// Package checkout serves the checkout page of the order service: GET /
// and its files under /checkout/.
//
// The page signs in with a bearer token and calls the order API (POST and
// GET /v1/orders) with it; see static/app.js for how it uses
// Idempotency-Key. With Options.Guest (orders serve --guest-checkout),
// POST /checkout/session signs in a fresh guest user ("guest-" and 32
// random hex digits) with a guest token (orders.IssueGuestToken: valid for
// TokenTTL, and for at most orders.DefaultGuestOrderLimit orders), at most
// SessionBurst at once and then one every SessionEvery per client address
// (429 beyond); the page keeps it in sessionStorage, so each browser tab is
// its own guest and sees only its own orders. Without it that route is 404
// and the page asks for a token made by `orders token --user ID`.
//
// Files are embedded (no build step, no external resources). Every error
// of this handler is application/problem+json, as the API's are.
package checkout

import (
	"crypto/rand"
	"embed"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/ratelimit"
	"github.com/idem-go/idem/problem"
)

//go:embed static
var static embed.FS

// Options configures Handler.
type Options struct {
	// Secret signs the guests' bearer tokens.
	Secret []byte
	// Now is the clock for the token's expiry and the sign-in rate
	// limit. Default time.Now.
	Now func() time.Time
	// Guest turns on the guest sign-in, POST /checkout/session. Off, that
	// route is 404 and the page says how to sign in with a token.
	Guest bool
}

// TokenTTL is how long a guest's bearer token is valid.
const TokenTTL = orders.GuestTokenTTL

// The rate limit of POST /checkout/session, per client address (an IPv6
// address counts by its /64 prefix): SessionBurst sign-ins at once, then
// one every SessionEvery.
const (
	SessionBurst = 10
	SessionEvery = 6 * time.Second
)

// Session is the answer of POST /checkout/session.
type Session struct {
	UserID    string    `json:"user_id"`
	Token     string    `json:"token"`
	TokenType string    `json:"token_type"` // "Bearer"
	ExpiresAt time.Time `json:"expires_at"`
}

// Content types of the page's files, by extension.
var contentTypes = map[string]string{
	".html": "text/html; charset=utf-8",
	".css":  "text/css; charset=utf-8",
	".js":   "text/javascript; charset=utf-8",
	".svg":  "image/svg+xml",
}

// contentSecurityPolicy allows the page's own files and API alone: no
// inline script or style, nothing from elsewhere.
const contentSecurityPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

type file struct {
	body        []byte
	contentType string
}

type handler struct {
	secret  []byte
	now     func() time.Time
	guest   bool
	limiter *ratelimit.Keyed
	files   map[string]file // by URL path: "/" and "/checkout/…"
}

// Marks in index.html that the page without guest sign-in changes: the
// body says guest checkout is off, and the sign-in section is shown.
const (
	guestOnMark       = `data-guest-checkout="on"`
	guestOffMark      = `data-guest-checkout="off"`
	signInHiddenMark  = `<section id="signin" aria-labelledby="signin-h" hidden>`
	signInVisibleMark = `<section id="signin" aria-labelledby="signin-h">`
)

// Handler serves GET / (the page), the page's files under /checkout/
// (GET or HEAD), and POST /checkout/session, which signs in a new guest
// user and answers a Session. Anything else is a problem+json 404 or 405.
func Handler(o Options) http.Handler {
	if len(o.Secret) == 0 {
		panic("checkout: Options.Secret is empty")
	}
	h := &handler{secret: o.Secret, now: o.Now, guest: o.Guest, files: make(map[string]file)}
	if h.now == nil {
		h.now = time.Now
	}
	h.limiter = ratelimit.New(SessionEvery, SessionBurst)
	entries, err := static.ReadDir("static")
	if err != nil {
		panic(err)
	}
	for _, e := range entries {
		ct, ok := contentTypes[path.Ext(e.Name())]
		if e.IsDir() || !ok {
			continue
		}
		b, err := static.ReadFile("static/" + e.Name())
		if err != nil {
			panic(err)
		}
		url := "/checkout/" + e.Name()
		if e.Name() == "index.html" {
			url = "/"
			if !o.Guest {
				b = pageWithoutGuest(b)
			}
		}
		h.files[url] = file{body: b, contentType: ct}
	}
	return h
}

const sessionPath = "/checkout/session"

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if r.URL.Path == sessionPath && h.guest {
		if r.Method != http.MethodPost {
			methodNotAllowed(w, r, "POST")
			return
		}
		if wait, ok := h.limiter.Allow(clientAddress(r), h.now()); !ok {
			tooManySessions(w, wait)
			return
		}
		h.session(w)
		return
	}
	f, ok := h.files[r.URL.Path]
	if !ok {
		problem.Write(w, problem.Details{Type: orders.ProblemNotFound, Title: "Not found", Status: http.StatusNotFound,
			Detail: "No route " + r.URL.Path + "."})
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		methodNotAllowed(w, r, "GET, HEAD")
		return
	}
	hd := w.Header()
	hd.Set("Content-Type", f.contentType)
	hd.Set("Content-Length", strconv.Itoa(len(f.body)))
	// The files are small and change with the binary: always revalidate.
	hd.Set("Cache-Control", "no-cache")
	if f.contentType == contentTypes[".html"] {
		hd.Set("Content-Security-Policy", contentSecurityPolicy)
		hd.Set("Referrer-Policy", "no-referrer")
	}
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodGet {
		w.Write(f.body)
	}
}

// session signs in a new guest user.
func (h *handler) session(w http.ResponseWriter) {
	var b [16]byte
	rand.Read(b[:])
	s := Session{UserID: "guest-" + hex.EncodeToString(b[:]), TokenType: "Bearer"}
	now := h.now()
	tok, err := orders.IssueGuestToken(h.secret, s.UserID, now)
	if err != nil {
		problem.Write(w, problem.Details{Type: problem.Internal, Title: "Internal Server Error", Status: http.StatusInternalServerError,
			Detail: "The guest token could not be made."})
		return
	}
	s.Token, s.ExpiresAt = tok, now.Add(TokenTTL).UTC().Truncate(time.Second)
	body, _ := json.Marshal(s)
	hd := w.Header()
	hd.Set("Content-Type", "application/json")
	hd.Set("Content-Length", strconv.Itoa(len(body)))
	hd.Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusCreated)
	w.Write(body)
}

// pageWithoutGuest returns the page b as served without guest sign-in:
// marked off, with its sign-in section shown.
func pageWithoutGuest(b []byte) []byte {
	p := string(b)
	if !strings.Contains(p, guestOnMark) || !strings.Contains(p, signInHiddenMark) {
		panic("checkout: index.html lacks " + guestOnMark + " or " + signInHiddenMark)
	}
	p = strings.Replace(p, guestOnMark, guestOffMark, 1)
	p = strings.Replace(p, signInHiddenMark, signInVisibleMark, 1)
	return []byte(p)
}

// tooManySessions answers 429 to a client that asked for guest sessions
// too often; it may ask again after wait.
func tooManySessions(w http.ResponseWriter, wait time.Duration) {
	secs := int((wait + time.Second - 1) / time.Second)
	w.Header().Set("Retry-After", strconv.Itoa(max(secs, 1)))
	problem.Write(w, problem.Details{Type: orders.ProblemRateLimited, Title: "Too many requests", Status: http.StatusTooManyRequests,
		Detail: "Too many guest sign-ins from this address: " + strconv.Itoa(SessionBurst) + " at once, then one every " +
			SessionEvery.String() + ". Retry after Retry-After seconds."})
}

func methodNotAllowed(w http.ResponseWriter, r *http.Request, allow string) {
	w.Header().Set("Allow", allow)
	problem.Write(w, problem.Details{Type: orders.ProblemMethodNotAllowed, Title: "Method not allowed", Status: http.StatusMethodNotAllowed,
		Detail: r.Method + " is not allowed on " + r.URL.Path + "."})
}
