// Package pgstore is an idem.Store on PostgreSQL, built on pgx.
//
// The handler's writes and the stored response commit in one database
// transaction (see Tx), so an order and the answer that reports it land
// together or not at all.
//
// # Claiming without waiting
//
// Claim never reads a row with FOR UPDATE and never holds a lock across a
// statement: it tries INSERT … ON CONFLICT (user_id, key) DO NOTHING as an
// autocommit statement, and if the key exists reads it with a plain SELECT
// and decides in Go. A takeover (the lease ran out) or the replacement of
// an expired record is one conditional UPDATE, itself an autocommit
// statement, guarded by the owner token it read; when it matches no row,
// another claim got there first and Claim reads again. The only waits are
// the ones PostgreSQL imposes on a statement that touches a row another
// transaction is writing right now (even INSERT … ON CONFLICT DO NOTHING
// waits for that transaction to end): another of this package's
// autocommit statements on the same key (a claim, Release, Fail or
// DeleteExpired), microseconds long, or Tx.Complete, whose fenced UPDATE
// is the last statement before COMMIT. The handler's transaction does not
// touch the key's row before Complete, so a repeat arriving while the
// handler runs gets its answer at once.
//
// # Clocks
//
// Leases and expiry are decided with the store's clock (Options.Now), whose
// times are passed to every statement; the database clock is not used.
// Skew between instances only moves a takeover earlier or later: fencing
// keeps a taken-over attempt from committing whatever the clocks say.
//
// # Schema
//
// Migrate creates the table idempotency_keys in the schema that the pool's
// search_path selects; ApplyMigrations applies other components'
// migrations the same way.
package pgstore

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/idem-go/idem"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

var (
	_ idem.Store   = (*Store)(nil)
	_ idem.Sweeper = (*Store)(nil)
	_ idem.Tx      = (*Tx)(nil)
)

// Options configures a Store. The zero value is usable.
type Options struct {
	// Now is the clock that decides leases and expiry. Default time.Now.
	// Times are stored with microsecond precision.
	Now func() time.Time
	// TxOptions are the options of the transactions Begin opens. Default:
	// the database's default isolation level (normally READ COMMITTED,
	// under which a fenced Complete matches no row; under REPEATABLE READ
	// or SERIALIZABLE it fails with a serialization error, which also
	// commits nothing).
	TxOptions pgx.TxOptions
}

// Store is an idem.Store and idem.Sweeper on PostgreSQL. Create it with New
// after Migrate. It is safe for concurrent use.
type Store struct {
	pool      *pgxpool.Pool
	now       func() time.Time
	txOptions pgx.TxOptions
}

// New returns a Store that keeps its records in pool's idempotency_keys
// table. It does not create the table; call Migrate first.
func New(pool *pgxpool.Pool, opts Options) *Store {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Store{pool: pool, now: opts.Now, txOptions: opts.TxOptions}
}

// clock returns the store's time, at the precision PostgreSQL keeps, so
// that the times a Lease reports are the ones stored.
func (s *Store) clock() time.Time {
	return s.now().Truncate(time.Microsecond)
}

// maxClaimRounds bounds Claim's read-and-retry loop. Each lost round means
// another claim or a delete changed the row in between; a second or third
// round sees a settled row.
const maxClaimRounds = 10

// errContention is returned when Claim lost maxClaimRounds races in a row.
var errContention = errors.New("pgstore: claim: the record kept changing")

// Claim implements idem.Store.
func (s *Store) Claim(ctx context.Context, p idem.ClaimParams) (idem.Claim, error) {
	p = p.Normalize()
	now := s.clock()
	header, err := marshalHeader(p.Header)
	if err != nil {
		return idem.Claim{}, err
	}
	for range maxClaimRounds {
		owner := newOwner()
		l, err := s.insert(ctx, p, header, owner, now)
		if err == nil {
			return idem.Claim{Lease: l}, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return idem.Claim{}, interpretError(err)
		}
		cur, err := s.readClaim(ctx, p.User, p.Key)
		if errors.Is(err, pgx.ErrNoRows) {
			continue // deleted since the insert: insert again
		}
		if err != nil {
			return idem.Claim{}, interpretError(err)
		}
		if now.Before(cur.expiresAt) {
			switch {
			case cur.fingerprint != p.Fingerprint:
				return idem.Claim{}, idem.ErrFingerprintMismatch
			case cur.response != nil:
				return idem.Claim{Response: cur.response}, nil
			case now.Before(cur.leaseUntil):
				return idem.Claim{}, &idem.InFlightError{LeaseUntil: cur.leaseUntil}
			}
			l, err = s.takeOver(ctx, p, cur.owner, owner, now)
		} else {
			l, err = s.replace(ctx, p, header, cur.owner, owner, now)
		}
		if err == nil {
			return idem.Claim{Lease: l}, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return idem.Claim{}, interpretError(err)
		}
		// Another claim changed the row since we read it: decide again.
	}
	return idem.Claim{}, errContention
}

// insert claims a free key. It returns pgx.ErrNoRows when the key exists.
func (s *Store) insert(ctx context.Context, p idem.ClaimParams, header []byte, owner string, now time.Time) (*idem.Lease, error) {
	l := &idem.Lease{User: p.User, Key: p.Key, Owner: owner}
	err := s.pool.QueryRow(ctx, `
INSERT INTO idempotency_keys
	(user_id, key, fingerprint, method, path, request_header, request_body,
	 owner, lease_until, attempts, created_at, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 1, $10, $11)
ON CONFLICT (user_id, key) DO NOTHING
RETURNING lease_until, attempts, created_at`,
		p.User, p.Key, p.Fingerprint, p.Method, p.Path, header, p.Body,
		owner, now.Add(p.Lease), now, now.Add(p.TTL),
	).Scan(&l.Until, &l.Attempt, &l.CreatedAt)
	if err != nil {
		return nil, err
	}
	return l, nil
}

// claimState is what Claim reads to decide about an existing key.
type claimState struct {
	fingerprint string
	owner       string
	leaseUntil  time.Time
	expiresAt   time.Time
	response    *idem.Response
}

func (s *Store) readClaim(ctx context.Context, user, key string) (*claimState, error) {
	var (
		c       claimState
		status  *int
		header  []byte
		respBdy []byte
	)
	err := s.pool.QueryRow(ctx, `
SELECT fingerprint, owner, lease_until, expires_at, response_status, response_header, response_body
FROM idempotency_keys
WHERE user_id = $1 AND key = $2`,
		user, key,
	).Scan(&c.fingerprint, &c.owner, &c.leaseUntil, &c.expiresAt, &status, &header, &respBdy)
	if err != nil {
		return nil, err
	}
	c.response, err = responseOf(status, header, respBdy)
	if err != nil {
		return nil, err
	}
	return &c, nil
}

// takeOver claims a live record whose lease ran out, if it is still the
// one read (owner oldOwner, no response). It returns pgx.ErrNoRows if not.
func (s *Store) takeOver(ctx context.Context, p idem.ClaimParams, oldOwner, owner string, now time.Time) (*idem.Lease, error) {
	l := &idem.Lease{User: p.User, Key: p.Key, Owner: owner}
	err := s.pool.QueryRow(ctx, `
UPDATE idempotency_keys
SET owner = $4, lease_until = $5, attempts = attempts + 1
WHERE user_id = $1 AND key = $2 AND owner = $3
	AND response_status IS NULL AND lease_until <= $6 AND expires_at > $6
RETURNING lease_until, attempts, created_at`,
		p.User, p.Key, oldOwner, owner, now.Add(p.Lease), now,
	).Scan(&l.Until, &l.Attempt, &l.CreatedAt)
	if err != nil {
		return nil, err
	}
	return l, nil
}

// replace turns an expired record, if it is still the one read (owner
// oldOwner), into a new one for p. It returns pgx.ErrNoRows if not.
func (s *Store) replace(ctx context.Context, p idem.ClaimParams, header []byte, oldOwner, owner string, now time.Time) (*idem.Lease, error) {
	l := &idem.Lease{User: p.User, Key: p.Key, Owner: owner}
	err := s.pool.QueryRow(ctx, `
UPDATE idempotency_keys
SET fingerprint = $4, method = $5, path = $6, request_header = $7, request_body = $8,
	owner = $9, lease_until = $10, attempts = 1,
	response_status = NULL, response_header = NULL, response_body = NULL,
	created_at = $11, completed_at = NULL, expires_at = $12
WHERE user_id = $1 AND key = $2 AND owner = $3 AND expires_at <= $11
RETURNING lease_until, attempts, created_at`,
		p.User, p.Key, oldOwner,
		p.Fingerprint, p.Method, p.Path, header, p.Body,
		owner, now.Add(p.Lease), now, now.Add(p.TTL),
	).Scan(&l.Until, &l.Attempt, &l.CreatedAt)
	if err != nil {
		return nil, err
	}
	return l, nil
}

// Release implements idem.Store.
func (s *Store) Release(ctx context.Context, l *idem.Lease) error {
	tag, err := s.pool.Exec(ctx, `
DELETE FROM idempotency_keys
WHERE user_id = $1 AND key = $2 AND owner = $3 AND response_status IS NULL`,
		l.User, l.Key, l.Owner)
	if err != nil {
		return interpretError(err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrFenced
	}
	return nil
}

// Fail implements idem.Store.
func (s *Store) Fail(ctx context.Context, l *idem.Lease) error {
	tag, err := s.pool.Exec(ctx, `
UPDATE idempotency_keys SET lease_until = $4
WHERE user_id = $1 AND key = $2 AND owner = $3 AND response_status IS NULL`,
		l.User, l.Key, l.Owner, s.clock())
	if err != nil {
		return interpretError(err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrFenced
	}
	return nil
}

// recordColumns are the columns scanRecord reads, in its order.
const recordColumns = `user_id, key, fingerprint, method, path, request_header, request_body,
	owner, lease_until, attempts, response_status, response_header, response_body,
	created_at, completed_at, expires_at`

// Get implements idem.Store.
func (s *Store) Get(ctx context.Context, user, key string) (*idem.Record, error) {
	rows, err := s.pool.Query(ctx, `
SELECT `+recordColumns+`
FROM idempotency_keys
WHERE user_id = $1 AND key = $2 AND expires_at > $3`,
		user, key, s.clock())
	if err != nil {
		return nil, interpretError(err)
	}
	rec, err := pgx.CollectExactlyOneRow(rows, scanRecord)
	if err != nil {
		return nil, interpretError(err)
	}
	return rec, nil
}

// Abandoned implements idem.Sweeper: records without a response whose
// lease ran out and which have not expired, oldest first.
//
// It takes no row locks: the records are candidates, which the completer
// still has to Claim, and locks held by a statement that ends at once would
// only make a concurrent takeover wait.
func (s *Store) Abandoned(ctx context.Context, limit int) ([]idem.Record, error) {
	if limit <= 0 {
		return nil, nil
	}
	rows, err := s.pool.Query(ctx, `
SELECT `+recordColumns+`
FROM idempotency_keys
WHERE response_status IS NULL AND lease_until <= $1 AND expires_at > $1
ORDER BY attempts, created_at, user_id, key
LIMIT $2`,
		s.clock(), limit)
	if err != nil {
		return nil, interpretError(err)
	}
	recs, err := pgx.CollectRows(rows, scanRecord)
	if err != nil {
		return nil, interpretError(err)
	}
	out := make([]idem.Record, len(recs))
	for i, r := range recs {
		out[i] = *r
	}
	return out, nil
}

// DeleteExpired implements idem.Sweeper: it deletes up to limit records
// whose expiry passed, oldest expiry first, except those with a live lease
// and no response. Rows another transaction is writing are skipped, not
// waited for; a later call deletes them.
//
// The batch is chosen by the expires_at index and deleted by ctid (a TID
// scan): a batch costs the same whatever the backlog of expired keys. The
// rows are locked by the same statement, so their ctids cannot change
// before the delete, and the conditions are checked again on delete.
func (s *Store) DeleteExpired(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	tag, err := s.pool.Exec(ctx, `
DELETE FROM idempotency_keys
WHERE ctid = ANY(ARRAY(
	SELECT ctid
	FROM idempotency_keys
	WHERE expires_at <= $1 AND NOT (response_status IS NULL AND lease_until > $1)
	ORDER BY expires_at
	LIMIT $2
	FOR UPDATE SKIP LOCKED
))
AND expires_at <= $1 AND NOT (response_status IS NULL AND lease_until > $1)`,
		s.clock(), limit)
	if err != nil {
		return 0, interpretError(err)
	}
	return int(tag.RowsAffected()), nil
}

// scanRecord reads the recordColumns of one row.
func scanRecord(row pgx.CollectableRow) (*idem.Record, error) {
	var (
		r           idem.Record
		reqHeader   []byte
		status      *int
		respHeader  []byte
		respBody    []byte
		completedAt *time.Time
	)
	err := row.Scan(&r.User, &r.Key, &r.Fingerprint, &r.Method, &r.Path, &reqHeader, &r.Body,
		&r.Owner, &r.LeaseUntil, &r.Attempts, &status, &respHeader, &respBody,
		&r.CreatedAt, &completedAt, &r.ExpiresAt)
	if err != nil {
		return nil, err
	}
	if r.Header, err = unmarshalHeader(reqHeader); err != nil {
		return nil, err
	}
	if r.Response, err = responseOf(status, respHeader, respBody); err != nil {
		return nil, err
	}
	if completedAt != nil {
		r.CompletedAt = *completedAt
	}
	return &r, nil
}

// responseOf assembles a stored response; status nil means none.
func responseOf(status *int, header, body []byte) (*idem.Response, error) {
	if status == nil {
		return nil, nil
	}
	h, err := unmarshalHeader(header)
	if err != nil {
		return nil, err
	}
	return &idem.Response{Status: *status, Header: h, Body: body}, nil
}

// marshalHeader encodes h for a jsonb column; a nil header is SQL NULL.
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

// interpretError translates a database error at the store's edge:
// pgx.ErrNoRows becomes idem.ErrNotFound, and every other error is wrapped
// so that errors.Is still finds it (context.Canceled, *pgconn.PgError).
func interpretError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, pgx.ErrNoRows):
		return idem.ErrNotFound
	default:
		return fmt.Errorf("pgstore: %w", err)
	}
}

// newOwner returns a fresh fencing token.
func newOwner() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
