package ordersapp

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/checkout"
	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/orders"
)

// guestDo sends method path to base with an optional bearer token and
// returns the answer's status, Content-Type and body.
func guestDo(t *testing.T, base, method, path, tok string) (int, string, string) {
	t.Helper()
	req, err := http.NewRequest(method, base+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header.Get("Content-Type"), string(b)
}

// TestServeGuestCheckoutOffByDefault: `orders serve` as configured by
// default answers POST /checkout/session 404 problem+json, as an unknown
// route; its page says how to sign in; a guest token (made with its own
// secret) is refused, and full tokens work.
func TestServeGuestCheckoutOffByDefault(t *testing.T) {
	c := &Config{DataDir: t.TempDir(), JWTSecret: testSecret, KeyTTL: 24 * time.Hour, KeyLease: 30 * time.Second,
		RequireKey: true, PaymentsKey: "sk_test_local"}
	svc := startInProcess(t, c)
	for _, m := range []string{http.MethodPost, http.MethodGet} {
		status, ct, body := guestDo(t, svc.base, m, "/checkout/session", "")
		var p struct{ Type string }
		if err := json.Unmarshal([]byte(body), &p); status != http.StatusNotFound || ct != "application/problem+json" || err != nil || p.Type != orders.ProblemNotFound {
			t.Errorf("%s /checkout/session: %d %q %s; want 404 not-found problem+json", m, status, ct, body)
		}
	}
	status, _, page := guestDo(t, svc.base, http.MethodGet, "/", "")
	if status != http.StatusOK || !strings.Contains(page, `data-guest-checkout="off"`) || !strings.Contains(page, "orders token --user ID") {
		t.Errorf("GET /: %d; want the page saying guest checkout is off and how to get a token", status)
	}
	guest, err := orders.IssueGuestToken([]byte(testSecret), "guest-0123", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if status, _, body := guestDo(t, svc.base, http.MethodGet, "/v1/orders", guest); status != http.StatusUnauthorized || !strings.Contains(body, "guest checkout is off") {
		t.Errorf("a guest token: %d %s; want 401 saying guest checkout is off", status, body)
	}
	if status, _, body := guestDo(t, svc.base, http.MethodGet, "/v1/orders", token(t, "alice")); status != http.StatusOK {
		t.Errorf("a full token: %d %s", status, body)
	}
}

// TestServeGuestCheckoutFlag: --guest-checkout and ORDERS_GUEST_CHECKOUT
// turn guest checkout on (default off; the flag wins), and serve --help
// says what it does.
func TestServeGuestCheckoutFlag(t *testing.T) {
	for _, c := range []struct {
		name string
		env  map[string]string
		args []string
		want bool
	}{
		{"default", nil, nil, false},
		{"flag", nil, []string{"--guest-checkout"}, true},
		{"env", map[string]string{"ORDERS_GUEST_CHECKOUT": "true"}, nil, true},
		{"flag wins", map[string]string{"ORDERS_GUEST_CHECKOUT": "true"}, []string{"--guest-checkout=false"}, false},
	} {
		var cfg Config
		fs := cli.NewFlagSet("orders serve", "", func(k string) string { return c.env[k] })
		cfg.serveFlags(fs)
		if err := fs.Parse(c.args); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if cfg.GuestCheckout != c.want {
			t.Errorf("%s: GuestCheckout %v, want %v", c.name, cfg.GuestCheckout, c.want)
		}
	}
	code, out, _ := run(t, nil, "serve", "--help")
	for _, want := range []string{"--guest-checkout", "ORDERS_GUEST_CHECKOUT", "POST /checkout/session", "15-minute", "at most 10 orders", "answers 404", "orders token --user ID"} {
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("serve --help lacks %q", want)
		}
	}
	if code, _, stderr := run(t, map[string]string{"ORDERS_GUEST_CHECKOUT": "maybe"}, "serve"); code != 2 || strings.Count(strings.TrimSpace(stderr), "\n") != 0 {
		t.Errorf("ORDERS_GUEST_CHECKOUT=maybe: exit %d, %q; want 2 and one line", code, stderr)
	}
}

// TestServeGuestCheckoutOn: with guest checkout on, a guest from POST
// /checkout/session orders through the API, for 15 minutes.
func TestServeGuestCheckoutOn(t *testing.T) {
	c := &Config{DataDir: t.TempDir(), JWTSecret: testSecret, KeyTTL: 24 * time.Hour, KeyLease: 30 * time.Second,
		RequireKey: true, PaymentsKey: "sk_test_local", GuestCheckout: true}
	svc := startInProcess(t, c)
	status, _, body := guestDo(t, svc.base, http.MethodPost, "/checkout/session", "")
	var s checkout.Session
	if err := json.Unmarshal([]byte(body), &s); status != http.StatusCreated || err != nil {
		t.Fatalf("POST /checkout/session: %d %s", status, body)
	}
	if d := time.Until(s.ExpiresAt); d > 15*time.Minute || d < 14*time.Minute {
		t.Errorf("the guest token expires in %v, want 15m", d)
	}
	req, _ := http.NewRequest(http.MethodPost, svc.base+"/v1/orders", strings.NewReader(orderBody(1)))
	req.Header.Set("Authorization", "Bearer "+s.Token)
	req.Header.Set("Idempotency-Key", "guest-order-1")
	req.Header.Set("Content-Type", "application/json; charset=utf-8")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Errorf("the guest's order: %d", resp.StatusCode)
	}
}

// TestTokenTTLCap: orders token --ttl takes at most 720h; longer exits 2
// with one line.
func TestTokenTTLCap(t *testing.T) {
	dir := t.TempDir()
	if code, out, stderr := run(t, nil, "token", "--user", "alice", "--data-dir", dir, "--ttl", "720h"); code != 0 || out == "" {
		t.Errorf("--ttl 720h: exit %d, %q %q", code, out, stderr)
	}
	for _, ttl := range []string{"721h", "876000h"} {
		code, out, stderr := run(t, nil, "token", "--user", "alice", "--data-dir", dir, "--ttl", ttl)
		if code != 2 || out != "" || strings.Count(strings.TrimRight(stderr, "\n"), "\n") != 0 || !strings.Contains(stderr, "720h") {
			t.Errorf("--ttl %s: exit %d, stdout %q, stderr %q; want 2, nothing, one line naming 720h", ttl, code, out, stderr)
		}
	}
	if code, _, stderr := run(t, map[string]string{"ORDERS_TOKEN_TTL": "1000h"}, "token", "--user", "alice", "--data-dir", dir); code != 2 {
		t.Errorf("ORDERS_TOKEN_TTL=1000h: exit %d, %q; want 2", code, stderr)
	}
}
