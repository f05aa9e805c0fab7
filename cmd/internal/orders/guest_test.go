package orders

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
)

// mint signs claims with b's secret, as a client that makes its own
// tokens does.
func (b *testBundle) mint(t *testing.T, claims jwt.MapClaims) string {
	t.Helper()
	tok, err := jwt.NewWithClaims(jwt.SigningMethodHS256, claims).SignedString(b.secret)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func (b *testBundle) guestToken(t *testing.T, user string) string {
	t.Helper()
	tok, err := IssueGuestToken(b.secret, user, b.clock.Now())
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func withGuests(limit int) func(*setupOptions) {
	return func(o *setupOptions) { o.guest, o.guestLimit = true, limit }
}

// TestTokenLifetime: a token valid for more than 720h (exp after now, or
// after its iat) is refused; tokens with only sub and exp, and those of
// IssueToken, up to 720h are accepted; IssueToken refuses a longer ttl.
func TestTokenLifetime(t *testing.T) {
	b := setup(t)
	now := b.clock.Now()
	list := func(tok string) int {
		t.Helper()
		return b.do(t, req{method: "GET", path: "/v1/orders", token: tok}).status
	}
	for _, c := range []struct {
		name   string
		claims jwt.MapClaims
		want   int
	}{
		{"sub and exp, 1h", jwt.MapClaims{"sub": "u", "exp": now.Add(time.Hour).Unix()}, http.StatusOK},
		{"sub and exp, 720h", jwt.MapClaims{"sub": "u", "exp": now.Add(720 * time.Hour).Unix()}, http.StatusOK},
		{"sub and exp, 721h", jwt.MapClaims{"sub": "u", "exp": now.Add(721 * time.Hour).Unix()}, http.StatusUnauthorized},
		{"sub and exp, 100 years", jwt.MapClaims{"sub": "u", "exp": now.Add(876000 * time.Hour).Unix()}, http.StatusUnauthorized},
		{"iat 10h ago, exp in 715h", jwt.MapClaims{"sub": "u", "iat": now.Add(-10 * time.Hour).Unix(), "exp": now.Add(715 * time.Hour).Unix()}, http.StatusUnauthorized},
		{"iat 10h ago, exp in 710h", jwt.MapClaims{"sub": "u", "iat": now.Add(-10 * time.Hour).Unix(), "exp": now.Add(710 * time.Hour).Unix()}, http.StatusOK},
		{"our issuer", jwt.MapClaims{"sub": "u", "iss": TokenIssuer, "exp": now.Add(time.Hour).Unix()}, http.StatusOK},
		{"another issuer", jwt.MapClaims{"sub": "u", "iss": "elsewhere", "exp": now.Add(time.Hour).Unix()}, http.StatusUnauthorized},
		{"unknown scope", jwt.MapClaims{"sub": "u", "scope": "admin", "exp": now.Add(time.Hour).Unix()}, http.StatusUnauthorized},
	} {
		if got := list(b.mint(t, c.claims)); got != c.want {
			t.Errorf("%s: %d, want %d", c.name, got, c.want)
		}
	}
	tok, err := IssueToken(b.secret, "u", MaxTokenLifetime, now)
	if err != nil || list(tok) != http.StatusOK {
		t.Errorf("IssueToken for 720h: %v, or refused", err)
	}
	if _, err := IssueToken(b.secret, "u", MaxTokenLifetime+time.Second, now); err == nil {
		t.Error("IssueToken for over 720h succeeded")
	}
	r := b.do(t, req{method: "GET", path: "/v1/orders", token: b.mint(t, jwt.MapClaims{"sub": "u", "exp": now.Add(800 * time.Hour).Unix()})})
	if p := r.wantProblem(t, http.StatusUnauthorized, ProblemUnauthorized); !strings.Contains(fmt.Sprint(p["detail"]), "720h") {
		t.Errorf("detail %v does not name the 720h bound", p["detail"])
	}
}

// TestGuestTokens: a guest token is accepted only while guest checkout is
// on, and only for 15 minutes; full tokens work either way.
func TestGuestTokens(t *testing.T) {
	off, on := setup(t), setup(t, withGuests(0))
	for _, c := range []struct {
		name string
		b    *testBundle
		want int
	}{{"guest checkout off", off, http.StatusUnauthorized}, {"guest checkout on", on, http.StatusOK}} {
		r := c.b.do(t, req{method: "GET", path: "/v1/orders", token: c.b.guestToken(t, "guest-1")})
		if r.status != c.want {
			t.Errorf("%s: a guest token: %s, want %d", c.name, r, c.want)
		}
		if r := c.b.do(t, req{method: "GET", path: "/v1/orders", token: c.b.token(t, "u")}); r.status != http.StatusOK {
			t.Errorf("%s: a full token: %s", c.name, r)
		}
	}
	now := on.clock.Now()
	long := on.mint(t, jwt.MapClaims{"sub": "guest-2", "scope": GuestScope, "iat": now.Unix(), "exp": now.Add(time.Hour).Unix()})
	if r := on.do(t, req{method: "GET", path: "/v1/orders", token: long}); r.status != http.StatusUnauthorized {
		t.Errorf("a guest token valid for an hour: %s, want 401", r)
	}
	noIat := on.mint(t, jwt.MapClaims{"sub": "guest-2", "scope": GuestScope, "exp": now.Add(time.Hour).Unix()})
	if r := on.do(t, req{method: "GET", path: "/v1/orders", token: noIat}); r.status != http.StatusUnauthorized {
		t.Errorf("a guest token without iat, valid for an hour: %s, want 401", r)
	}
	tok := on.guestToken(t, "guest-3")
	on.clock.Advance(GuestTokenTTL + time.Second)
	if r := on.do(t, req{method: "GET", path: "/v1/orders", token: tok}); r.status != http.StatusUnauthorized {
		t.Errorf("a guest token after 15 minutes: %s, want 401", r)
	}
}

// TestGuestOrderLimit: a guest makes at most GuestOrderLimit orders; the
// next is refused with 403 before the payment, its key left free, while
// replays of the guest's orders, other guests and full tokens go on.
func TestGuestOrderLimit(t *testing.T) {
	b := setup(t, withGuests(0))
	guest := b.guestToken(t, "guest-a")
	post := func(tok, key string) response {
		t.Helper()
		return b.do(t, req{method: "POST", path: "/v1/orders", token: tok, key: key, body: orderBody})
	}
	for i := range DefaultGuestOrderLimit {
		if r := post(guest, fmt.Sprintf("k%d", i)); r.status != http.StatusCreated {
			t.Fatalf("order %d: %s", i+1, r)
		}
	}
	calls := b.payer.callCount()
	for range 2 { // the key stays free: the same refusal, not a 409 or 422
		p := post(guest, "k-over").wantProblem(t, http.StatusForbidden, ProblemGuestOrderLimit)
		if d := fmt.Sprint(p["detail"]); !strings.Contains(d, "10 orders") {
			t.Errorf("detail %q", d)
		}
	}
	if n := b.payer.callCount(); n != calls {
		t.Errorf("%d payments for refused orders", n-calls)
	}
	if r := post(guest, "k0"); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("a replay of the guest's first order: %s %v", r, r.header)
	}
	if r := post(b.guestToken(t, "guest-b"), "k-over"); r.status != http.StatusCreated {
		t.Errorf("another guest: %s", r)
	}
	full := b.token(t, "guest-a") // a full token for the same user id: no cap
	if r := post(full, "k-full"); r.status != http.StatusCreated {
		t.Errorf("a full token: %s", r)
	}
	if n := b.countOrders(t); n != DefaultGuestOrderLimit+2 {
		t.Errorf("%d orders, want %d", n, DefaultGuestOrderLimit+2)
	}
}

// TestGuestOrderLimitConcurrent: orders of one guest sent at once, all
// paying slowly, make no more than the cap: the slots in flight count.
func TestGuestOrderLimitConcurrent(t *testing.T) {
	const limit, sent = 2, 6
	b := setup(t, withGuests(limit))
	block, entered := make(chan struct{}), make(chan struct{}, sent)
	b.payer.mu.Lock()
	b.payer.block, b.payer.entered = block, entered
	b.payer.mu.Unlock()
	guest := b.guestToken(t, "guest-c")
	var wg sync.WaitGroup
	answers := make(chan response, sent)
	for i := range sent {
		wg.Go(func() {
			r, err := b.tryDo(req{method: "POST", path: "/v1/orders", token: guest, key: fmt.Sprintf("c%d", i), body: orderBody})
			if err != nil {
				t.Error(err)
			}
			answers <- r
		})
	}
	// The refusals come at once; the admitted ones wait in the payment.
	refused := 0
	for refused < sent-limit {
		select {
		case r := <-answers:
			r.wantProblem(t, http.StatusForbidden, ProblemGuestOrderLimit)
			refused++
		case <-time.After(10 * time.Second):
			t.Fatalf("%d refusals, want %d", refused, sent-limit)
		}
	}
	close(block)
	wg.Wait()
	close(answers)
	for r := range answers {
		if r.status != http.StatusCreated {
			t.Errorf("an admitted order: %s", r)
		}
	}
	if n := b.countOrders(t); n != limit {
		t.Errorf("%d orders, want %d", n, limit)
	}
	if r := b.do(t, req{method: "POST", path: "/v1/orders", token: guest, key: "after", body: orderBody}); r.status != http.StatusForbidden {
		t.Errorf("after the cap: %s", r)
	}
}

// TestCreateContentType: POST /v1/orders takes application/json (any
// case, parameters allowed) or no Content-Type; anything else is 415
// before the key is claimed or anyone is charged. What the middleware
// keeps of the header is the bare media type.
func TestCreateContentType(t *testing.T) {
	b := setup(t)
	tok := b.token(t, "u")
	post := func(key string, header map[string]string) response {
		t.Helper()
		return b.do(t, req{method: "POST", path: "/v1/orders", token: tok, key: key, body: orderBody, header: header})
	}
	for _, ct := range []string{"text/plain", "application/x-www-form-urlencoded", "application/jsonx", "application/problem+json", "", "json"} {
		r := post("ct-1", map[string]string{"Content-Type": ct})
		r.wantProblem(t, http.StatusUnsupportedMediaType, ProblemUnsupportedMediaType)
		if r.header.Get("Accept-Post") != "application/json" || r.header.Get("Idempotency-Key") != "ct-1" {
			t.Errorf("%q: headers %v", ct, r.header)
		}
	}
	if n := b.payer.callCount(); n != 0 {
		t.Fatalf("%d payments for refused requests", n)
	}
	// The key was never claimed: a corrected request may use it.
	if r := post("ct-1", nil); r.status != http.StatusCreated {
		t.Fatalf("application/json after the 415s: %s", r)
	}
	for i, ct := range []string{"application/json; charset=utf-8", "Application/JSON", " application/json ;charset=UTF-8"} {
		if r := post(fmt.Sprintf("ct-ok-%d", i), map[string]string{"Content-Type": ct}); r.status != http.StatusCreated {
			t.Errorf("%q: %s", ct, r)
		}
	}
	// No Content-Type: read as JSON.
	hr, err := http.NewRequest("POST", b.srv.URL+"/v1/orders", strings.NewReader(orderBody))
	if err != nil {
		t.Fatal(err)
	}
	hr.Header.Set("Authorization", "Bearer "+tok)
	hr.Header.Set("Idempotency-Key", "ct-none")
	resp, err := b.srv.Client().Do(hr)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Errorf("no Content-Type: %d", resp.StatusCode)
	}
	// Two Content-Type headers: 415.
	hr, _ = http.NewRequest("POST", b.srv.URL+"/v1/orders", strings.NewReader(orderBody))
	hr.Header.Set("Authorization", "Bearer "+tok)
	hr.Header["Content-Type"] = []string{"application/json", "text/plain"}
	if resp, err = b.srv.Client().Do(hr); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnsupportedMediaType {
		t.Errorf("two Content-Types: %d", resp.StatusCode)
	}
	// A 60 KB Content-Type of JSON is taken, and not kept whole.
	huge := "application/json; x=" + strings.Repeat("a", 60<<10)
	if r := post("ct-huge", map[string]string{"Content-Type": huge}); r.status != http.StatusCreated {
		t.Fatalf("a 60 KB application/json Content-Type: %s", r)
	}
	var kept int
	if err := b.store.DB().QueryRow(`SELECT length(request_header) FROM idempotency_keys WHERE key = 'ct-huge'`).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	if kept > 256 {
		t.Errorf("%d bytes of request headers kept, want the bare media type", kept)
	}
}
