package orders

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/golang-jwt/jwt/v5"
)

// Limits and marks of the bearer tokens the service issues and accepts.
const (
	// TokenIssuer is the iss claim of the tokens the service issues
	// (IssueToken, IssueGuestToken). A token without iss is accepted (tokens
	// made elsewhere carry only sub and exp); one that names another
	// issuer is refused.
	TokenIssuer = "orders"
	// MaxTokenLifetime bounds how long a token may be valid: IssueToken
	// refuses a longer ttl, and the API refuses (401) a token whose exp is
	// more than this after its iat, or more than this (plus
	// tokenClockLeeway) after now.
	MaxTokenLifetime = 720 * time.Hour
	// GuestScope is the scope claim of a guest token (IssueGuestToken):
	// the API accepts it only while guest checkout is on, for no longer
	// than GuestTokenTTL, and caps the orders of its user (see
	// Config.GuestOrderLimit). A token without a scope is a full token; one
	// with any other scope is refused.
	GuestScope = "guest"
	// GuestTokenTTL is how long a guest token is valid.
	GuestTokenTTL = 15 * time.Minute
	// tokenClockLeeway is how far the issuer's clock may be ahead of this
	// instance's when the lifetime of a token is checked against now.
	tokenClockLeeway = time.Minute
)

// tokenClaims are the claims of a bearer token: the registered ones and
// the service's scope ("" or GuestScope).
type tokenClaims struct {
	jwt.RegisteredClaims
	Scope string `json:"scope,omitempty"`
}

// IssueToken returns an HS256 JWT for user, signed with secret, issued at
// now and valid for ttl (at most MaxTokenLifetime): the bearer token the API
// accepts.
func IssueToken(secret []byte, user string, ttl time.Duration, now time.Time) (string, error) {
	if ttl > MaxTokenLifetime {
		return "", fmt.Errorf("orders: token ttl %v is over %v", ttl, MaxTokenLifetime)
	}
	return issue(secret, user, "", ttl, now)
}

// IssueGuestToken returns a guest token for user, issued at now: valid for
// GuestTokenTTL, with the scope claim GuestScope.
func IssueGuestToken(secret []byte, user string, now time.Time) (string, error) {
	return issue(secret, user, GuestScope, GuestTokenTTL, now)
}

func issue(secret []byte, user, scope string, ttl time.Duration, now time.Time) (string, error) {
	switch {
	case len(secret) == 0:
		return "", errors.New("orders: empty JWT secret")
	case CheckTokenUser(user) != nil:
		return "", fmt.Errorf("orders: %w", CheckTokenUser(user))
	case ttl <= 0:
		return "", errors.New("orders: token ttl must be positive")
	}
	claims := tokenClaims{
		RegisteredClaims: jwt.RegisteredClaims{
			Issuer:    TokenIssuer,
			Subject:   user,
			IssuedAt:  jwt.NewNumericDate(now),
			ExpiresAt: jwt.NewNumericDate(now.Add(ttl)),
		},
		Scope: scope,
	}
	return jwt.NewWithClaims(jwt.SigningMethodHS256, claims).SignedString(secret)
}

// MaxUser is the longest user id, the bearer token's sub claim, in bytes.
// The user id is part of every order and of every stored answer, so it is
// bounded like the Idempotency-Key.
const MaxUser = 255

type userKey struct{}

// withUser returns ctx carrying the authenticated user.
func withUser(ctx context.Context, user string) context.Context {
	return context.WithValue(ctx, userKey{}, user)
}

// UserFromContext returns the user that the request's bearer token
// authenticated.
func UserFromContext(ctx context.Context) (string, bool) {
	u, ok := ctx.Value(userKey{}).(string)
	return u, ok && u != ""
}

// identity is who a bearer token authenticated.
type identity struct {
	user  string
	guest bool // a guest token (scope GuestScope)
}

type guestKey struct{}

// withGuest returns ctx marking its user as a guest.
func withGuest(ctx context.Context) context.Context {
	return context.WithValue(ctx, guestKey{}, true)
}

// guestFromContext reports whether the request's token is a guest token.
func guestFromContext(ctx context.Context) bool {
	g, _ := ctx.Value(guestKey{}).(bool)
	return g
}

// authenticate returns the user named by the request's bearer token, or
// a detail for the 401; guest tokens are refused.
func authenticate(r *http.Request, secret []byte, now func() time.Time) (string, string) {
	id, detail := authenticateToken(r, secret, now, false)
	return id.user, detail
}

// authenticateToken returns who the request's bearer token names, or a
// detail for the 401. Guest tokens are accepted only when guests is set.
func authenticateToken(r *http.Request, secret []byte, now func() time.Time, guests bool) (identity, string) {
	h := r.Header.Values("Authorization")
	if len(h) == 0 {
		return identity{}, "The request has no Authorization header; send Authorization: Bearer <token>."
	}
	if len(h) > 1 {
		return identity{}, "The request has more than one Authorization header."
	}
	scheme, raw, ok := strings.Cut(strings.TrimSpace(h[0]), " ")
	raw = strings.TrimSpace(raw)
	if !ok || !strings.EqualFold(scheme, "Bearer") || raw == "" {
		return identity{}, "The Authorization header must be Bearer <token>."
	}
	var claims tokenClaims
	_, err := jwt.ParseWithClaims(raw, &claims,
		func(*jwt.Token) (any, error) { return secret, nil },
		jwt.WithValidMethods([]string{jwt.SigningMethodHS256.Alg()}),
		jwt.WithExpirationRequired(),
		jwt.WithTimeFunc(now),
	)
	switch {
	case err == nil:
	case errors.Is(err, jwt.ErrTokenMalformed):
		return identity{}, "The bearer token is not a well-formed JWT."
	case errors.Is(err, jwt.ErrTokenSignatureInvalid):
		return identity{}, "The bearer token's signature is invalid or its algorithm is not HS256."
	case errors.Is(err, jwt.ErrTokenUnverifiable):
		return identity{}, "The bearer token cannot be verified; it must be signed with HS256."
	case errors.Is(err, jwt.ErrTokenRequiredClaimMissing):
		return identity{}, "The bearer token has no exp claim."
	case errors.Is(err, jwt.ErrTokenExpired):
		return identity{}, "The bearer token has expired."
	case errors.Is(err, jwt.ErrTokenNotValidYet):
		return identity{}, "The bearer token is not valid yet."
	default:
		return identity{}, "The bearer token is invalid."
	}
	switch {
	case claims.Subject == "":
		return identity{}, "The bearer token has no sub claim."
	case len(claims.Subject) > MaxUser:
		return identity{}, fmt.Sprintf("The bearer token's sub claim is over %d bytes.", MaxUser)
	case !plainText(claims.Subject):
		return identity{}, "The bearer token's sub claim is not UTF-8 text without control characters."
	case strings.HasPrefix(claims.Subject, ReservedUserPrefix):
		return identity{}, fmt.Sprintf("The bearer token's sub claim begins with %q, which is reserved for the service's own consumers.", ReservedUserPrefix)
	case claims.Issuer != "" && claims.Issuer != TokenIssuer:
		return identity{}, fmt.Sprintf("The bearer token's iss claim is not %q.", TokenIssuer)
	}
	// The lifetime: bounded for every token, and shorter for a guest's.
	limit := MaxTokenLifetime
	switch claims.Scope {
	case "":
	case GuestScope:
		if !guests {
			return identity{}, "The bearer token is a guest token, and guest checkout is off on this server; get a token from `orders token --user ID`."
		}
		limit = GuestTokenTTL
	default:
		return identity{}, "The bearer token's scope claim is not one this API grants."
	}
	exp := claims.ExpiresAt.Time
	if exp.Sub(now()) > limit+tokenClockLeeway || (claims.IssuedAt != nil && exp.Sub(claims.IssuedAt.Time) > limit) {
		return identity{}, fmt.Sprintf("The bearer token is valid for longer than %s; make one with a shorter lifetime.", shortDuration(limit))
	}
	return identity{user: claims.Subject, guest: claims.Scope == GuestScope}, ""
}

// shortDuration writes d without its zero minutes and seconds (720h, 15m).
func shortDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}
