package pgstore

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"time"

	"github.com/idem-go/idem/idemdriver"
	"github.com/jackc/pgx/v5"
)

// recordColumns are the columns scanRecord reads, in its order.
const recordColumns = `user_id, key, fingerprint, method, path, request_header, request_body,
	owner, lease_until, attempts, redrives, response_status, response_header, response_body,
	response_trailer, created_at, completed_at, expires_at`

// Get implements idem.Store: a record without a response is returned
// whatever its expiry; a completed one until its expiry.
func (s *Store) Get(ctx context.Context, user, key string) (*idemdriver.Record, error) {
	rows, err := s.pool.Query(ctx, s.q(`
SELECT `+recordColumns+`
FROM idempotency_keys
WHERE user_id = $1 AND key = $2
	AND (response_status IS NULL OR expires_at > coalesce($3::timestamptz, statement_timestamp()))`), s.mode,
		user, key, s.at())
	if err != nil {
		return nil, interpretError(err)
	}
	rec, err := pgx.CollectExactlyOneRow(rows, scanRecord)
	if err != nil {
		return nil, interpretError(err)
	}
	return rec, nil
}

// abandonedSQL selects the records Abandoned returns. $1 is the test
// clock's time or NULL, $2 MaxRedrives (0: none; redrives is an integer,
// so a larger budget is math.MaxInt32), $3 Backoff and $4 MaxBackoff in
// nanoseconds (0: none), $5 the limit, $6 NULL for every kind of record
// or whether HTTP records are selected, and $7 the Do operations selected
// (idemdriver.AbandonedParams.Kinds).
//
// The backoff after n >= 1 re-drives, min(Backoff·2^(n−1), MaxBackoff)
// nanoseconds, is computed in numeric, exactly, and bounded by
// math.MaxInt64 nanoseconds as idemdriver.AbandonedParams.BackoffAfter bounds it
// (2^63 times any backoff is beyond that, hence the exponent's bound), so
// no redrives count makes the statement fail. It is compared, in
// nanoseconds and exactly too, with the time since the lease ended
// (extract(epoch …) of an interval is numeric): the decision is
// idemdriver.AbandonedParams.Due's, to the nanosecond of the parameters, while
// the times themselves are whole microseconds.
//
// The partial index idempotency_keys_abandoned_order_idx holds exactly the
// records without a response, in the order of the ORDER BY: the scan stops
// after the limit, reading past only the keys left out (given up, or
// waiting for their backoff).
const abandonedSQL = `
SELECT ` + recordColumns + `
FROM idempotency_keys
WHERE response_status IS NULL
	AND lease_until <= coalesce($1::timestamptz, statement_timestamp())
	AND ($2::integer <= 0 OR redrives < $2::integer)
	AND (redrives <= 0 OR $3::bigint <= 0
		OR extract(epoch FROM coalesce($1::timestamptz, statement_timestamp()) - lease_until) * 1000000000
			>= least(
				$3::bigint::numeric * power(2::numeric, least(redrives - 1, 63)),
				CASE WHEN $4::bigint > 0 THEN $4::bigint::numeric ELSE 9223372036854775807 END,
				9223372036854775807))
	AND ($6::boolean IS NULL OR (method <> '' AND $6::boolean)
		OR (method = '' AND path = ANY($7::text[])))
ORDER BY lease_until, created_at, user_id, key
LIMIT $5`

// Abandoned implements idemdriver.Sweeper: records without a response whose
// lease ran out, expired or not (an attempt that may have paid is finished
// whatever the TTL), that are due by p (fewer than p.MaxRedrives re-drives,
// their backoff passed since the lease ended: idemdriver.AbandonedParams.Due)
// and of the kinds p.Kinds selects (idemdriver.AbandonedParams.Selects), the
// earliest lease end first, then the oldest record, then user and key.
// The database's clock decides, as for everything else (see Clocks).
//
// It takes no row locks: the records are candidates, which the completer
// still has to Claim, and locks held by a statement that ends at once would
// only make a concurrent takeover wait.
func (s *Store) Abandoned(ctx context.Context, p idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	if p.Limit <= 0 {
		return nil, nil
	}
	var selectHTTP *bool // nil: every kind
	ops := []string{}
	if p.Kinds != nil {
		selectHTTP = &p.Kinds.HTTP
		ops = append(ops, p.Kinds.StoredOperations()...)
	}
	rows, err := s.pool.Query(ctx, s.q(abandonedSQL), s.mode,
		s.at(), min(max(p.MaxRedrives, 0), math.MaxInt32), max(int64(p.Backoff), 0), max(int64(p.MaxBackoff), 0), p.Limit,
		selectHTTP, ops)
	if err != nil {
		return nil, interpretError(err)
	}
	recs, err := pgx.CollectRows(rows, scanRecord)
	if err != nil {
		return nil, interpretError(err)
	}
	out := make([]idemdriver.Record, len(recs))
	for i, r := range recs {
		out[i] = *r
	}
	return out, nil
}

// DeleteExpired implements idemdriver.Sweeper: it deletes up to limit completed
// records whose expiry passed, oldest expiry first. A record without a
// response is never deleted by expiry: its attempt may have paid, and the
// completer must still be able to finish it. Rows another transaction is
// writing are skipped, not waited for; a later call deletes them.
//
// The batch is chosen by the partial index of completed records' expiry
// (idempotency_keys_completed_expires_at_idx), so records without a response
// that outlived their TTL are not scanned again by every batch, and deleted
// by ctid (a TID scan). The rows are locked by the same statement, so their
// ctids cannot change before the delete, and the conditions are checked
// again on delete. The statement is deleteExpiredSQL, which Clean runs too.
//
// Each call scans the index from the oldest expiry, through the entries of
// the rows earlier calls deleted until a VACUUM removes them: while a large
// backlog is deleted, later batches cost more. Clean avoids that.
func (s *Store) DeleteExpired(ctx context.Context, limit int) (int, error) {
	n, _, err := s.deleteExpired(ctx, limit, nil)
	return n, err
}

// scanRecord reads the recordColumns of one row.
func scanRecord(row pgx.CollectableRow) (*idemdriver.Record, error) {
	var (
		r           idemdriver.Record
		reqHeader   []byte
		status      *int
		respHeader  []byte
		respBody    []byte
		respTrailer []byte
		completedAt *time.Time
	)
	err := row.Scan(&r.User, &r.Key, &r.Fingerprint, &r.Method, &r.Path, &reqHeader, &r.Body,
		&r.Owner, &r.LeaseUntil, &r.Attempts, &r.Redrives, &status, &respHeader, &respBody,
		&respTrailer, &r.CreatedAt, &completedAt, &r.ExpiresAt)
	if err != nil {
		return nil, err
	}
	if r.Header, err = unmarshalHeader(reqHeader); err != nil {
		return nil, err
	}
	if r.Response, err = responseOf(status, respHeader, respBody, respTrailer); err != nil {
		return nil, err
	}
	if completedAt != nil {
		r.CompletedAt = *completedAt
	}
	return &r, nil
}

// responseOf assembles a stored response; status nil means none, and
// trailer NULL no trailers (every row completed before 0004).
func responseOf(status *int, header, body, trailer []byte) (*idemdriver.Response, error) {
	if status == nil {
		return nil, nil
	}
	h, err := unmarshalHeader(header)
	if err != nil {
		return nil, err
	}
	t, err := unmarshalHeader(trailer)
	if err != nil {
		return nil, err
	}
	return &idemdriver.Response{Status: *status, Header: h, Body: body, Trailer: t}, nil
}

// marshalHeader encodes h for a jsonb column; a nil header is SQL NULL.
// Statements pass it through jsonText: as []byte, pgx's exec and
// simple_protocol modes would send it as bytea, which a jsonb column
// refuses.
func marshalHeader(h http.Header) ([]byte, error) {
	if h == nil {
		return nil, nil
	}
	b, err := json.Marshal(h)
	if err != nil {
		return nil, fmt.Errorf("pgstore: encoding header: %w", err)
	}
	return b, nil
}

func unmarshalHeader(b []byte) (http.Header, error) {
	if b == nil {
		return nil, nil
	}
	var h http.Header
	if err := json.Unmarshal(b, &h); err != nil {
		return nil, fmt.Errorf("pgstore: decoding stored header: %w", err)
	}
	return h, nil
}
