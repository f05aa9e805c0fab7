// Package checkout serves the checkout page of the order service: GET /
// and its files under /checkout/.
//
// The page is a demo guest checkout. POST /checkout/session signs in a
// fresh guest user ("guest-" and 32 random hex digits) with a bearer token
// valid for TokenTTL; the page keeps it in sessionStorage, so each browser
// tab is its own guest and sees only its own orders. The page then calls
// the order API (POST and GET /v1/orders) with that token; see
// static/app.js for how it uses Idempotency-Key.
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
	"time"

	"github.com/idem-go/idem/internal/orders"
	"github.com/idem-go/idem/problem"
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

// TokenTTL is how long a guest's bearer token is valid.
const TokenTTL = time.Hour

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
	secret []byte
	now    func() time.Time
	files  map[string]file // by URL path: "/" and "/checkout/…"
}

// Handler serves GET / (the page), the page's files under /checkout/
// (GET or HEAD), and POST /checkout/session, which signs in a new guest
// user and answers a Session. Anything else is a problem+json 404 or 405.
func Handler(o Options) http.Handler {
	if len(o.Secret) == 0 {
		panic("checkout: Options.Secret is empty")
	}
	h := &handler{secret: o.Secret, now: o.Now, files: make(map[string]file)}
	if h.now == nil {
		h.now = time.Now
	}
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
		}
		h.files[url] = file{body: b, contentType: ct}
	}
	return h
}

const sessionPath = "/checkout/session"

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("X-Content-Type-Options", "nosniff")
	if r.URL.Path == sessionPath {
		if r.Method != http.MethodPost {
			methodNotAllowed(w, r, "POST")
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
	tok, err := orders.IssueToken(h.secret, s.UserID, TokenTTL, now)
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

func methodNotAllowed(w http.ResponseWriter, r *http.Request, allow string) {
	w.Header().Set("Allow", allow)
	problem.Write(w, problem.Details{Type: orders.ProblemMethodNotAllowed, Title: "Method not allowed", Status: http.StatusMethodNotAllowed,
		Detail: r.Method + " is not allowed on " + r.URL.Path + "."})
}
