package orders

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/golang-jwt/jwt/v5"
)

// badIDCases are order ids and cursors that no database keeps (NUL, bytes
// that are not UTF-8, a control character, too long): the id names no
// order of the caller's (404) and the cursor is invalid (400), never the
// 503 of a database that refuses the bytes (PostgreSQL: SQLSTATE 22021).
var badIDCases = []struct {
	path string
	want int
}{
	{"/v1/orders/ord_%00", http.StatusNotFound},
	{"/v1/orders/ord_%FF", http.StatusNotFound},
	{"/v1/orders/ord_a%00b", http.StatusNotFound},
	{"/v1/orders/ord_%0A", http.StatusNotFound},
	{"/v1/orders/ord_" + strings.Repeat("x", MaxOrderID), http.StatusNotFound},
	{"/v1/orders?starting_after=ord_%00", http.StatusBadRequest},
	{"/v1/orders?starting_after=ord_%FF", http.StatusBadRequest},
	{"/v1/orders?starting_after=ord_%7F", http.StatusBadRequest},
	{"/v1/orders?starting_after=ord_" + strings.Repeat("x", MaxOrderID), http.StatusBadRequest},
}

func TestBadIDsAreClientErrorsOnPostgres(t *testing.T) {
	b := pgSetup(t, nil)
	for _, tc := range badIDCases {
		if r := b.get(t, "alice", tc.path); r.status != tc.want {
			t.Errorf("GET %.60s: %s; want %d", tc.path, r, tc.want)
		}
	}
}

func TestBadIDsAreClientErrorsOnSQLite(t *testing.T) {
	b := setup(t)
	for _, tc := range badIDCases {
		if r := b.get(t, "alice", tc.path); r.status != tc.want {
			t.Errorf("GET %.60s: %s; want %d", tc.path, r, tc.want)
		}
	}
}

// TestPostgresRepositoryBadIDIsNotFound: the repository itself answers an
// id that PostgreSQL refuses (class 22) with ErrNotFound, as a safety net
// for a caller that did not check it.
func TestPostgresRepositoryBadIDIsNotFound(t *testing.T) {
	b := pgSetup(t, nil)
	ctx := context.Background()
	for _, id := range []string{"ord_\x00", "ord_\xff"} {
		if _, err := b.pgRepo.Get(ctx, "alice", id); !errors.Is(err, ErrNotFound) {
			t.Errorf("Get(%q): %v; want ErrNotFound", id, err)
		}
		if _, _, err := b.pgRepo.List(ctx, "alice", 10, id); !errors.Is(err, ErrNotFound) {
			t.Errorf("List(starting_after %q): %v; want ErrNotFound", id, err)
		}
	}
}

// badUsers are subs that cannot be user ids: not UTF-8 text without
// control characters.
var badUsers = []string{"eve\x00", "eve\n", "\teve", "eve\x7f", "eve\u0085", "eve\xff"}

// signedWithSub is a token that any issuer sharing the secret can make,
// whose sub is user.
func signedWithSub(t *testing.T, secret []byte, user string, now time.Time) string {
	t.Helper()
	tok, err := jwt.NewWithClaims(jwt.SigningMethodHS256, jwt.RegisteredClaims{
		Subject:   user,
		IssuedAt:  jwt.NewNumericDate(now),
		ExpiresAt: jwt.NewNumericDate(now.Add(time.Hour)),
	}).SignedString(secret)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// TestIssueTokenRefusesBadUser: IssueToken makes no token for a user id
// that holds NUL, another control character or bytes that are not UTF-8.
func TestIssueTokenRefusesBadUser(t *testing.T) {
	for _, u := range badUsers {
		if _, err := IssueToken([]byte("s"), u, time.Minute, time.Now()); err == nil {
			t.Errorf("IssueToken(%q) succeeded", u)
		}
	}
	for _, u := range []string{"bob", "Zoë", "user@example.com", "a b"} {
		if _, err := IssueToken([]byte("s"), u, time.Minute, time.Now()); err != nil {
			t.Errorf("IssueToken(%q): %v", u, err)
		}
	}
}

// TestTokenSubWithControlCharacterOnPostgres: a token signed with the
// service's secret whose sub holds NUL or another control character is
// the caller's mistake: 401 on every route, as a sub over 255 bytes is,
// never a 503 after retried claims (PostgreSQL refuses NUL).
func TestTokenSubWithControlCharacterOnPostgres(t *testing.T) {
	b := pgSetup(t, nil)
	for _, u := range badUsers {
		if !utf8.ValidString(u) {
			continue // JSON carries no such sub: the encoder makes it U+FFFD
		}
		tok := signedWithSub(t, b.secret, u, b.clock.Now())
		if r := b.do(t, req{method: "POST", path: "/v1/orders", token: tok, key: "k-bad-sub", body: orderBody}); r.status != http.StatusUnauthorized {
			t.Errorf("POST with sub %q: %s; want 401", u, r)
		}
		for _, path := range []string{"/v1/orders", "/v1/orders/ord_x"} {
			if r := b.do(t, req{method: "GET", path: path, token: tok}); r.status != http.StatusUnauthorized {
				t.Errorf("GET %s with sub %q: %s; want 401", path, u, r)
			}
		}
	}
	if n := b.countOrders(t); n != 0 {
		t.Errorf("%d orders, want 0", n)
	}
}

// TestInvalidUTF8QueryOnPostgresIsNot5xx checks that POST /v1/orders whose
// query is not UTF-8 is answered a 4xx (or the order) on PostgreSQL, not
// 503.
//
// Review 8, finding: on PostgreSQL, POST /v1/orders whose request target
// carries a query string that is not UTF-8 (net/http accepts it; the order
// API ignores the query) is answered 503 "idempotency store unavailable"
// after two seconds of retries: the middleware keeps r.URL.RequestURI()
// in the claim, and pgstore's text column refuses the byte
// (SQLSTATE 22021). Every retry gets the same 503: a 5xx for a client's
// mistake, which a client that follows Retry-After repeats for ever.
func TestInvalidUTF8QueryOnPostgresIsNot5xx(t *testing.T) {
	b := pgSetup(t, nil)
	conn, err := net.Dial("tcp", strings.TrimPrefix(b.srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	raw := "POST /v1/orders?ref=\xff HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b.token(t, "alice") + "\r\n" +
		"Idempotency-Key: k-utf8\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(orderBody)) + "\r\n\r\n" + orderBody
	if _, err := conn.Write([]byte(raw)); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	t.Logf("answer: %d %s", resp.StatusCode, body)
	if resp.StatusCode >= 500 {
		t.Fatalf("a request target with a non-UTF-8 query is answered %d, want a 4xx (or the order)", resp.StatusCode)
	}
}
