package orders

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/idem-go/idem/cmd/internal/ratelimit"
)

// Defaults of the bounds on what one user may make the service do and keep.
const (
	// DefaultUserRateEvery and DefaultUserRateBurst: a user's POST
	// /v1/orders, DefaultUserRateBurst at once, then one per
	// DefaultUserRateEvery (1,000 a second), per instance. A user may be a
	// merchant's whole back end: the bound stops a runaway client, not a
	// busy one.
	DefaultUserRateEvery = time.Millisecond
	DefaultUserRateBurst = 2000
	// DefaultMaxLiveKeys is how many idempotency keys one user may hold
	// unexpired (each keeps its answer, under 2 KB for an order, for the
	// key TTL).
	DefaultMaxLiveKeys = 1_000_000
)

// LiveKeyCounter is implemented by the repositories that can count a
// user's unexpired idempotency keys (the PostgreSQL and SQLite ones, on
// the store's table in the same database); the service bounds them with
// Config.MaxLiveKeys.
type LiveKeyCounter interface {
	// LiveKeys counts user's keys that have not expired, up to limit, and
	// returns the earliest time one of them expires. Keys are live while
	// their expiry is after now (the instance's clock: a skew of seconds
	// to the store's does not matter for keys kept a TTL).
	LiveKeys(ctx context.Context, user string, limit int, now time.Time) (n int, soonest time.Time, err error)
}

// LiveKeys implements LiveKeyCounter.
func (r *PostgresRepository) LiveKeys(ctx context.Context, user string, limit int, now time.Time) (int, time.Time, error) {
	var n int
	var soonest *time.Time
	err := r.pool.QueryRow(ctx, `
SELECT count(*), min(expires_at) FROM (
	SELECT expires_at FROM idempotency_keys WHERE user_id = $1 AND expires_at > $3 LIMIT $2
) k`, user, limit, now).Scan(&n, &soonest)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("orders: counting %s's keys: %w", user, err)
	}
	if soonest == nil {
		return n, time.Time{}, nil
	}
	return n, *soonest, nil
}

// LiveKeys implements LiveKeyCounter.
func (r *SQLiteRepository) LiveKeys(ctx context.Context, user string, limit int, now time.Time) (int, time.Time, error) {
	var n int
	var soonest sql.NullInt64
	err := r.db.QueryRowContext(ctx, `
SELECT count(*), min(expires_at) FROM (
	SELECT expires_at FROM idempotency_keys WHERE user_id = ? AND expires_at > ? LIMIT ?
) k`, user, now.UnixNano(), limit).Scan(&n, &soonest)
	if err != nil {
		return 0, time.Time{}, fmt.Errorf("orders: counting %s's keys: %w", user, err)
	}
	if !soonest.Valid {
		return n, time.Time{}, nil
	}
	return n, time.Unix(0, soonest.Int64), nil
}

// limitUser answers 429 ProblemRateLimited (with Retry-After) to a user's
// POST /v1/orders beyond Config.UserRateBurst at once and one per
// Config.UserRateEvery after, before the key is claimed: a replay counts
// too. The bucket is this instance's.
func (s *server) limitUser(next http.Handler) http.Handler {
	if s.users == nil {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, _ := UserFromContext(r.Context())
		if wait, ok := s.users.Allow(user, time.Now()); !ok {
			w.Header().Set("Retry-After", strconv.Itoa(ratelimit.RetryAfter(wait)))
			writeProblem(w, newProblem(ProblemRateLimited, http.StatusTooManyRequests, "Too many requests",
				"This user sends orders faster than "+strconv.Itoa(s.cfg.UserRateBurst)+" at once and one per "+s.cfg.UserRateEvery.String()+
					" after. Nothing was claimed or charged; retry with the same Idempotency-Key after Retry-After seconds."))
			return
		}
		next.ServeHTTP(w, r)
	})
}

// admitLiveKeys answers 429 ProblemTooManyKeys (with Retry-After: until
// the user's first key expires) and returns false when user holds more
// than Config.MaxLiveKeys unexpired keys, this request's included. A
// count that fails lets the request in (the database's failure shows
// where it matters) and is logged.
func (s *server) admitLiveKeys(ctx context.Context, w http.ResponseWriter, user string) bool {
	c, ok := s.cfg.Repo.(LiveKeyCounter)
	if !ok || s.cfg.MaxLiveKeys < 0 {
		return true
	}
	limit := s.cfg.MaxLiveKeys
	now := s.cfg.Now()
	n, soonest, err := c.LiveKeys(ctx, user, limit+1, now)
	if err != nil {
		s.cfg.Logger.WarnContext(ctx, "orders: counting a user's keys; let in", "user", user, "err", err)
		return true
	}
	if n <= limit {
		return true
	}
	w.Header().Set("Retry-After", strconv.Itoa(ratelimit.RetryAfter(soonest.Sub(now))))
	writeProblem(w, newProblem(ProblemTooManyKeys, http.StatusTooManyRequests, "Too many idempotency keys",
		"This user holds "+strconv.Itoa(limit)+" unexpired Idempotency-Keys, the most one user may; each is kept for the key TTL. "+
			"Nothing was charged or stored; retry with the same key after Retry-After seconds, when the oldest expires."))
	return false
}
