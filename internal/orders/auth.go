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

// IssueToken returns an HS256 JWT for user, signed with secret, issued at
// now and valid for ttl: the bearer token the API accepts.
func IssueToken(secret []byte, user string, ttl time.Duration, now time.Time) (string, error) {
	switch {
	case len(secret) == 0:
		return "", errors.New("orders: empty JWT secret")
	case CheckTokenUser(user) != nil:
		return "", fmt.Errorf("orders: %w", CheckTokenUser(user))
	case ttl <= 0:
		return "", errors.New("orders: token ttl must be positive")
	}
	claims := jwt.RegisteredClaims{
		Subject:   user,
		IssuedAt:  jwt.NewNumericDate(now),
		ExpiresAt: jwt.NewNumericDate(now.Add(ttl)),
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

// authenticate returns the user named by the request's bearer token, or
// a detail for the 401.
func authenticate(r *http.Request, secret []byte, now func() time.Time) (string, string) {
	h := r.Header.Values("Authorization")
	if len(h) == 0 {
		return "", "The request has no Authorization header; send Authorization: Bearer <token>."
	}
	if len(h) > 1 {
		return "", "The request has more than one Authorization header."
	}
	scheme, raw, ok := strings.Cut(strings.TrimSpace(h[0]), " ")
	raw = strings.TrimSpace(raw)
	if !ok || !strings.EqualFold(scheme, "Bearer") || raw == "" {
		return "", "The Authorization header must be Bearer <token>."
	}
	var claims jwt.RegisteredClaims
	_, err := jwt.ParseWithClaims(raw, &claims,
		func(*jwt.Token) (any, error) { return secret, nil },
		jwt.WithValidMethods([]string{jwt.SigningMethodHS256.Alg()}),
		jwt.WithExpirationRequired(),
		jwt.WithTimeFunc(now),
	)
	switch {
	case err == nil:
	case errors.Is(err, jwt.ErrTokenMalformed):
		return "", "The bearer token is not a well-formed JWT."
	case errors.Is(err, jwt.ErrTokenSignatureInvalid):
		return "", "The bearer token's signature is invalid or its algorithm is not HS256."
	case errors.Is(err, jwt.ErrTokenUnverifiable):
		return "", "The bearer token cannot be verified; it must be signed with HS256."
	case errors.Is(err, jwt.ErrTokenRequiredClaimMissing):
		return "", "The bearer token has no exp claim."
	case errors.Is(err, jwt.ErrTokenExpired):
		return "", "The bearer token has expired."
	case errors.Is(err, jwt.ErrTokenNotValidYet):
		return "", "The bearer token is not valid yet."
	default:
		return "", "The bearer token is invalid."
	}
	switch {
	case claims.Subject == "":
		return "", "The bearer token has no sub claim."
	case len(claims.Subject) > MaxUser:
		return "", fmt.Sprintf("The bearer token's sub claim is over %d bytes.", MaxUser)
	case !plainText(claims.Subject):
		return "", "The bearer token's sub claim is not UTF-8 text without control characters."
	case strings.HasPrefix(claims.Subject, ReservedUserPrefix):
		return "", fmt.Sprintf("The bearer token's sub claim begins with %q, which is reserved for the service's own consumers.", ReservedUserPrefix)
	}
	return claims.Subject, ""
}
