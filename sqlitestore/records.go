package sqlitestore

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/idem-go/idem/idemdriver"
)

// Get implements idem.Store. A record without a response is returned
// whatever its expiry; a completed one whose expiry passed is ErrNotFound.
func (s *Store) Get(ctx context.Context, user, key string) (*idemdriver.Record, error) {
	rec, err := scanRecord(s.db.QueryRowContext(ctx,
		selectRecord+` WHERE user_id = ? AND key = ? AND (response_status IS NULL OR expires_at > ?)`,
		user, key, toNanos(s.now())))
	if err != nil {
		return nil, interpretError("get", err)
	}
	return rec, nil
}

// Abandoned implements idemdriver.Sweeper: up to p.Limit records without a
// response whose lease ran out, expired or not (an attempt that may have
// paid is finished whatever the TTL), that are due by p (idemdriver.AbandonedParams.Due,
// by the store's clock): fewer than p.MaxRedrives re-drives, and their
// backoff passed; of the kinds p.Kinds selects (idemdriver.AbandonedParams.Selects).
// The earliest lease end comes first, then the oldest record, then user
// and key.
//
// The backoff is computed in SQL on the index, in integer arithmetic that
// cannot overflow: with d = now − lease_until (>= 0) and n >= 1 re-drives,
// d >= min(Backoff·2^(n−1), MaxBackoff) is d >= MaxBackoff (when capped)
// or d>>(n−1) >= Backoff, as ⌊d/2^k⌋ >= b exactly when d >= b·2^k; a shift
// of 63 or more leaves 0, which no positive Backoff reaches.
func (s *Store) Abandoned(ctx context.Context, p idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	if p.Limit <= 0 {
		return nil, nil
	}
	ops := []byte("[]")
	if p.Kinds != nil {
		if names := p.Kinds.StoredOperations(); len(names) > 0 {
			var err error
			if ops, err = json.Marshal(names); err != nil {
				return nil, fmt.Errorf("sqlitestore: abandoned: %w", err)
			}
		}
	}
	rows, err := s.db.QueryContext(ctx, selectAbandoned,
		sql.Named("now", toNanos(s.now())),
		sql.Named("max_redrives", int64(p.MaxRedrives)),
		sql.Named("backoff", int64(p.Backoff)),
		sql.Named("max_backoff", int64(p.MaxBackoff)),
		sql.Named("limit", int64(p.Limit)),
		sql.Named("all_kinds", p.Kinds == nil),
		sql.Named("http", p.Kinds != nil && p.Kinds.HTTP),
		sql.Named("operations", string(ops)))
	if err != nil {
		return nil, interpretError("abandoned", err)
	}
	defer rows.Close()
	var out []idemdriver.Record
	for rows.Next() {
		rec, err := scanRecord(rows)
		if err != nil {
			return nil, interpretError("abandoned", err)
		}
		out = append(out, *rec)
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError("abandoned", err)
	}
	return out, nil
}

// DeleteExpired implements idemdriver.Sweeper: it deletes up to limit completed
// records whose expiry passed, in one short statement. A record without a
// response is never deleted by expiry: its attempt may have paid, and the
// completer finishes it.
func (s *Store) DeleteExpired(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	unlock, err := s.lockWrites(ctx)
	if err != nil {
		return 0, err
	}
	defer unlock()
	res, err := s.db.ExecContext(ctx, `
		DELETE FROM idempotency_keys WHERE rowid IN (
			SELECT rowid FROM idempotency_keys
			WHERE response_status IS NOT NULL AND expires_at <= ?
			ORDER BY expires_at
			LIMIT ?)`, toNanos(s.now()), limit)
	if err != nil {
		return 0, interpretError("delete expired", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, interpretError("delete expired", err)
	}
	return int(n), nil
}

// selectAbandoned is Abandoned's query. INDEXED BY holds it to the index
// that serves its order (idempotency_keys_abandoned, migration 0003), so
// that it reads rows in order and stops at the limit, and tests the
// redrives and backoff on the index entries before reading a row.
const selectAbandoned = selectRecord + `
	INDEXED BY idempotency_keys_abandoned
	WHERE response_status IS NULL AND lease_until <= :now
		AND (:max_redrives <= 0 OR redrives < :max_redrives)
		AND (redrives <= 0 OR :backoff <= 0
			OR (:max_backoff > 0 AND :now - lease_until >= :max_backoff)
			OR ((:now - lease_until) >> min(redrives - 1, 63)) >= :backoff)
		AND (:all_kinds OR (method <> '' AND :http)
			OR (method = '' AND path IN (SELECT value FROM json_each(:operations))))
	ORDER BY lease_until, created_at, user_id, key
	LIMIT :limit`

// selectRecord selects the columns scanRecord reads.
const selectRecord = `
	SELECT user_id, key, fingerprint, method, path, request_header, request_body, request_body IS NULL,
		owner, lease_until, attempts, redrives, response_status, response_header, response_body, response_body IS NULL,
		response_trailer, created_at, completed_at, expires_at
	FROM idempotency_keys`

// scanRecord reads a row of selectRecord. Its errors are for the caller to
// interpret: a missing row is sql.ErrNoRows.
func scanRecord(row interface{ Scan(...any) error }) (*idemdriver.Record, error) {
	var (
		rec                          idemdriver.Record
		reqHeader                    string
		reqBodyNull, respBodyNull    bool
		leaseUntil, created, expires int64
		respStatus, completed        sql.NullInt64
		respHeader, respTrailer      sql.NullString
		respBody                     []byte
	)
	err := row.Scan(&rec.User, &rec.Key, &rec.Fingerprint, &rec.Method, &rec.Path, &reqHeader, &rec.Body, &reqBodyNull,
		&rec.Owner, &leaseUntil, &rec.Attempts, &rec.Redrives, &respStatus, &respHeader, &respBody, &respBodyNull,
		&respTrailer, &created, &completed, &expires)
	if err != nil {
		return nil, err
	}
	rec.Body = blob(rec.Body, reqBodyNull)
	if rec.Header, err = decodeHeader(reqHeader); err != nil {
		return nil, err
	}
	rec.LeaseUntil = fromNanos(leaseUntil)
	rec.CreatedAt = fromNanos(created)
	rec.ExpiresAt = fromNanos(expires)
	if completed.Valid {
		rec.CompletedAt = fromNanos(completed.Int64)
	}
	if respStatus.Valid {
		resp := &idemdriver.Response{Status: int(respStatus.Int64), Body: blob(respBody, respBodyNull)}
		if resp.Header, err = decodeHeader(respHeader.String); err != nil {
			return nil, err
		}
		if resp.Trailer, err = decodeHeader(respTrailer.String); err != nil {
			return nil, err
		}
		rec.Response = resp
	}
	return &rec, nil
}

// blob restores an empty, non-NULL blob, which the driver reads as nil.
func blob(b []byte, isNull bool) []byte {
	if b == nil && !isNull {
		return []byte{}
	}
	return b
}

// encodeHeader stores h as JSON; a nil header is "null".
func encodeHeader(h http.Header) (string, error) {
	b, err := json.Marshal(h)
	if err != nil {
		return "", fmt.Errorf("sqlitestore: encoding header: %w", err)
	}
	return string(b), nil
}

func decodeHeader(s string) (http.Header, error) {
	if s == "" {
		return nil, nil
	}
	var h http.Header
	if err := json.Unmarshal([]byte(s), &h); err != nil {
		return nil, fmt.Errorf("decoding header: %w", err)
	}
	return h, nil
}

// Times are stored as Unix nanoseconds, and read back in UTC, so that a
// value derived from one (see idemdriver.Lease.CreatedAt) is the same on every
// instance.
func toNanos(t time.Time) int64 { return t.UnixNano() }

func fromNanos(n int64) time.Time { return time.Unix(0, n).UTC() }
