package orders

import (
	"context"
	"errors"
	"net/http"
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
