// Package pgstore is an idem.Store on PostgreSQL, built on pgx.
//
// The handler's writes and the stored response commit in one database
// transaction (see Tx), so an order and the answer that reports it land
// together or not at all.
//
// [Migrate] creates or upgrades the store's table, [New] makes the store on
// a pgxpool.Pool, and a handler writes through the request's pgx.Tx, which
// [FromContext] returns (also behind redisfront). Example creates an order
// once and replays it to the retry; ExampleApplyMigrations migrates the
// service's own tables. Both run against a PostgreSQL server in go test.
//
// # Claiming without waiting
//
// Claim never reads a row with FOR UPDATE and never holds a lock across a
// statement: it tries INSERT … ON CONFLICT (user_id, key) DO NOTHING as an
// autocommit statement which, when the key exists, also reads the key's
// row with the database's time (one statement, one round trip: a replay
// or a 409 costs nothing more), and decides in Go. That statement is a
// call of the function idem_claim (migration 0006), whose plans
// PostgreSQL keeps for the session; its SELECT, after the INSERT, also
// sees a row that a concurrent claim committed while the INSERT waited.
// The call names the store's table as the store's other statements
// resolve it, and the function claims in no other table. On a schema
// without the function (a rolling deploy ahead of its migration), or when
// the function found is not the table's, Claim sends the same steps as
// one statement instead, for the rest of the store's life; that
// statement's snapshot, taken before the INSERT, does not show a row
// committed while the INSERT waited, and Claim then reads it in a plain
// SELECT (as it does when the row was deleted in between). A takeover
// (the lease ran out) or the replacement of a completed record whose
// expiry passed is one conditional UPDATE, itself an autocommit
// statement, guarded by the owner token it read and by its condition
// checked again; when it matches no row,
// another claim got there first and Claim reads again. A record without a
// response is never replaced, whatever its expiry says: its attempt may have
// paid, so it is only ever taken over, as the same operation. The only
// waits are the ones PostgreSQL imposes on a statement that touches a row
// another transaction is writing right now (even INSERT … ON CONFLICT DO
// NOTHING waits for that transaction to end): another of this package's
// autocommit statements on the same key (a claim, Release or Fail,
// microseconds long, or a batch of DeleteExpired or Clean, which holds the
// expired rows it deletes for milliseconds), or Tx.Complete, whose fenced
// UPDATE is sent with COMMIT in one round trip. The handler's transaction does not
// touch the key's row before Complete, so a repeat arriving while the
// handler runs gets its answer at once.
//
// A completer's claim (ClaimParams.Redrive) never inserts and never
// replaces: it reads the row with the database's time, answers
// idem.ErrNotDue when the operation it listed is gone, answered or
// replaced (another created_at), or not due at that time by
// Redrive.Due (idemdriver.AbandonedParams.Due, decided in Go), and otherwise
// takes the record over with the same kind of conditional UPDATE, which
// also requires the created_at, lease end and re-drive count it read and
// counts the re-drive. Completers working from lists made at the same
// moment therefore take a key over once per backoff, and a stale listing
// never takes over a newer operation on the same key.
//
// The lease's owner token is ClaimParams.Owner, so a Claim sent again after
// its answer was lost (the connection dropped after the INSERT or UPDATE
// committed) finds its own token on the row and returns that lease as
// stored, instead of ErrInFlight.
//
// # Clocks
//
// The database's clock decides. Every time a statement writes or compares
// (a lease's start and end, a record's creation, completion and expiry, what
// Abandoned and DeleteExpired select, a re-drive's backoff included) is the
// database's statement_timestamp(), read in the statement that decides, and
// the times Claim returns come back from that statement. Claim decides
// about an existing key with the time read in the same SELECT as the row,
// and its conditional UPDATE checks the condition again by the database's
// clock. Instances whose clocks disagree therefore agree on every lease,
// expiry and backoff: an instance whose clock runs ahead cannot replace a
// completed key before its TTL ends, nor take over or clean a record whose
// lease another instance holds. The process's clock is not used
// (Options.Now is a test clock). Fencing keeps a taken-over attempt from
// committing in any case.
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
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

var (
	_ idem.Store         = (*Store)(nil)
	_ idemdriver.Sweeper = (*Store)(nil)
	_ idem.Tx            = (*Tx)(nil)
)

// Options configures a Store. The zero value is usable.
type Options struct {
	// Now is a test clock; never set it in production. Nil (the default):
	// the database's clock decides leases and expiry (see Clocks in the
	// package documentation). Set, its time (truncated to the microsecond,
	// PostgreSQL's precision) is passed to every statement in place of the
	// database's, so that tests can move time; the SQL is otherwise the
	// same.
	Now func() time.Time
	// TxOptions are the options of the transactions Begin opens. Default:
	// the database's default isolation level (normally READ COMMITTED,
	// under which a fenced Complete matches no row; under REPEATABLE READ
	// or SERIALIZABLE it fails with a serialization error, which also
	// commits nothing).
	TxOptions pgx.TxOptions
	// Schema is the schema that holds the store's table: every statement
	// names it (schema.idempotency_keys), so the pool's search_path does
	// not matter, which is what a pooler in transaction mode needs
	// (PgBouncer refuses search_path as a startup parameter, or drops it).
	// Migrate the table there with MigrateSchema. Default "": the table
	// is unqualified and the pool's search_path selects it.
	Schema string
	// QueryExecMode is the pgx mode of the store's own statements (a
	// handler's statements keep the pool's mode). Default 0: the pool's
	// DefaultQueryExecMode, except that pgx's own default,
	// QueryExecModeCacheStatement, is replaced by
	// QueryExecModeCacheDescribe, and QueryExecModeSimpleProtocol by
	// QueryExecModeExec (pgx refuses to write arguments into a simple
	// query on a session whose client_encoding is not UTF8, which is
	// the database's encoding when the pool does not set it; Exec works
	// wherever the simple protocol does). Every mode but CacheStatement and
	// DescribeExec works behind a pooler in transaction mode
	// (PgBouncer's pool_mode = transaction): CacheStatement prepares named
	// statements on the server connection, which the next transaction may
	// not get, and DescribeExec sends a statement's description and its
	// execution in two round trips. Set CacheStatement explicitly for the
	// fastest statements on a direct connection (or a pooler that keeps
	// prepared statements, PgBouncer 1.21 and later with
	// max_prepared_statements). Complete always sends its completion and
	// COMMIT as one simple-protocol query (see Tx.Complete).
	QueryExecMode pgx.QueryExecMode
}

// Store is an idem.Store and idemdriver.Sweeper on PostgreSQL. Create it with New
// after Migrate. It is safe for concurrent use.
type Store struct {
	pool      *pgxpool.Pool
	now       func() time.Time // Options.Now: a test clock, or nil
	txOptions pgx.TxOptions
	mode      pgx.QueryExecMode // the store's statements' mode: Options.QueryExecMode
	table     string            // the table's qualified name; "" unqualified
	stmts     sync.Map          // statement text → its text with table (when set)
	claimSQL  string            // the call of idem_claim, qualified as the table is
	// noClaimFunc is set once a claim found no idem_claim (a schema not
	// yet migrated to 0006, during a rolling deploy): claims then send
	// insertOrReadSQL, as before it.
	noClaimFunc atomic.Bool
}

// New returns a Store that keeps its records in pool's idempotency_keys
// table (in Options.Schema, if set). It does not create the table; call
// Migrate (or MigrateSchema) first.
func New(pool *pgxpool.Pool, opts Options) *Store {
	s := &Store{pool: pool, now: opts.Now, txOptions: opts.TxOptions, mode: opts.QueryExecMode}
	if s.mode == 0 {
		s.mode = StatementMode(pool)
	}
	fn, table := "idem_claim", "idempotency_keys"
	if opts.Schema != "" {
		s.table = pgx.Identifier{opts.Schema, "idempotency_keys"}.Sanitize()
		fn, table = pgx.Identifier{opts.Schema, "idem_claim"}.Sanitize(), s.table
	}
	// The table is named as the store's other statements name it, and
	// resolved here, by the caller's search_path: idem_claim refuses to
	// claim in another table (see the migration), such as its own
	// schema's when the search_path finds the function in a later schema
	// than the table.
	// The time is read here too, as every other statement of the store
	// reads it (the same statement_timestamp() the function would read,
	// found by the caller's search_path), so that the claim and the
	// conditional UPDATE that may follow it decide by the same clock.
	s.claimSQL = "SELECT * FROM " + fn + "($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, " +
		"coalesce($11::timestamptz, statement_timestamp()), '" + strings.ReplaceAll(table, "'", "''") + "'::regclass)"
	return s
}

// StatementMode is the pgx query mode in which a component's own
// statements on pool work behind a pooler in transaction mode and on any
// session encoding: the pool's DefaultQueryExecMode, except that
// cache_statement (pgx's default: named prepared statements) becomes
// cache_describe and simple_protocol becomes exec. It is the default of
// Options.QueryExecMode, and the outbox's mode.
func StatementMode(pool *pgxpool.Pool) pgx.QueryExecMode {
	switch mode := pool.Config().ConnConfig.DefaultQueryExecMode; mode {
	case pgx.QueryExecModeCacheStatement:
		return pgx.QueryExecModeCacheDescribe
	case pgx.QueryExecModeSimpleProtocol:
		return pgx.QueryExecModeExec
	default:
		return mode
	}
}

// q returns statement with the table named as Options.Schema says: as
// it is without a schema, else with every idempotency_keys qualified
// (the statements name no other object that begins so).
func (s *Store) q(statement string) string {
	if s.table == "" {
		return statement
	}
	if v, ok := s.stmts.Load(statement); ok {
		return v.(string)
	}
	v, _ := s.stmts.LoadOrStore(statement, strings.ReplaceAll(statement, "idempotency_keys", s.table))
	return v.(string)
}

// at returns the test clock's time for a statement's
// coalesce($n::timestamptz, statement_timestamp()), at the precision
// PostgreSQL keeps; nil (SQL NULL: the database's clock) without one.
func (s *Store) at() *time.Time {
	if s.now == nil {
		return nil
	}
	t := s.now().Truncate(time.Microsecond)
	return &t
}

// maxClaimRounds bounds Claim's read-and-retry loop. Each lost round means
// another claim or a delete changed the row in between; a second or third
// round sees a settled row.
const maxClaimRounds = 10

// errContention is returned when Claim lost maxClaimRounds races in a row.
var errContention = errors.New("pgstore: claim: the record kept changing")

// Claim implements idem.Store.
//
// Every statement reads the time as coalesce($n, statement_timestamp()):
// the database's clock, or the test clock's time when Options.Now is set.
func (s *Store) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	p = p.Normalize()
	at := s.at()
	header, err := marshalHeader(p.Header)
	if err != nil {
		return idemdriver.Claim{}, err
	}
	owner := p.Owner
	if owner == "" {
		owner = newOwner()
	}
	if p.Redrive != nil {
		return s.redrive(ctx, p, owner, at)
	}
	for range maxClaimRounds {
		c, cur, err := s.insertOrRead(ctx, p, header, owner, at)
		if err == nil && cur == nil {
			return c, nil
		}
		if err != nil {
			if !rowChanged(err) {
				return idemdriver.Claim{}, interpretError(err)
			}
			// The key's row is not visible to the statement's snapshot
			// (a concurrent claim committed it while the INSERT waited),
			// or, under REPEATABLE READ or SERIALIZABLE, the INSERT lost a
			// race: read it in a statement of its own.
			cur, err = s.readClaim(ctx, p.User, p.Key, at)
			if errors.Is(err, pgx.ErrNoRows) {
				continue // deleted since the insert: insert again
			}
			if err != nil {
				return idemdriver.Claim{}, interpretError(err)
			}
		}
		// Only a completed record expires; one without a response is
		// kept, whatever its expiry says, since its attempt may have paid.
		switch {
		case cur.response != nil && !cur.now.Before(cur.expiresAt):
			c, err = s.replace(ctx, p, header, cur.owner, owner, at)
		case cur.fingerprint != p.Fingerprint:
			return idemdriver.Claim{}, idem.ErrFingerprintMismatch
		case cur.response != nil:
			return idemdriver.Claim{Response: cur.response, ExpiresIn: expiresIn(cur.expiresAt, cur.now)}, nil
		case cur.owner == owner:
			// This attempt's own earlier claim, whose answer was lost:
			// the lease as stored, the attempt counted once.
			l := &idemdriver.Lease{User: p.User, Key: p.Key, Owner: owner, Until: cur.leaseUntil, Attempt: cur.attempts, CreatedAt: cur.createdAt}
			return idemdriver.Claim{Lease: l, ExpiresIn: expiresIn(cur.expiresAt, cur.now)}, nil
		case cur.now.Before(cur.leaseUntil):
			return idemdriver.Claim{}, &idem.InFlightError{LeaseUntil: cur.leaseUntil}
		default:
			c, err = s.takeOver(ctx, p, cur.owner, owner, at)
		}
		if err == nil {
			return c, nil
		}
		if !rowChanged(err) {
			return idemdriver.Claim{}, interpretError(err)
		}
		// Another claim changed the row since we read it: decide again.
	}
	return idemdriver.Claim{}, errContention
}

// redrive is Claim for a completer re-driving the operation it listed
// (p.Redrive): it never inserts and never replaces. It reads the row with
// the database's time in one SELECT, decides in Go (the operation gone,
// answered or replaced, or not due by p.Redrive.Due at that time:
// idem.ErrNotDue), and takes the record over with one conditional
// autocommit UPDATE on everything it decided on; when that matches no row,
// the record changed in between, and it reads and decides again.
func (s *Store) redrive(ctx context.Context, p idemdriver.ClaimParams, owner string, at *time.Time) (idemdriver.Claim, error) {
	for range maxClaimRounds {
		cur, err := s.readClaim(ctx, p.User, p.Key, at)
		if errors.Is(err, pgx.ErrNoRows) {
			return idemdriver.Claim{}, idem.ErrNotDue // gone: released, or deleted
		}
		if err != nil {
			return idemdriver.Claim{}, interpretError(err)
		}
		var c idemdriver.Claim
		switch {
		case cur.response != nil || !cur.createdAt.Equal(p.Redrive.CreatedAt):
			// Answered, or another operation on the same key: not the
			// one listed, whatever its expiry or lease.
			return idemdriver.Claim{}, idem.ErrNotDue
		case cur.fingerprint != p.Fingerprint:
			return idemdriver.Claim{}, idem.ErrFingerprintMismatch
		case cur.owner == owner:
			// This claim sent again after its answer was lost: the lease
			// as stored, counted once.
			l := &idemdriver.Lease{User: p.User, Key: p.Key, Owner: owner, Until: cur.leaseUntil, Attempt: cur.attempts, CreatedAt: cur.createdAt}
			return idemdriver.Claim{Lease: l, ExpiresIn: expiresIn(cur.expiresAt, cur.now)}, nil
		case cur.now.Before(cur.leaseUntil):
			return idemdriver.Claim{}, &idem.InFlightError{LeaseUntil: cur.leaseUntil}
		case !p.Redrive.Due.Due(cur.record(p.User, p.Key), cur.now):
			// Given up, or in its backoff, by the database's clock.
			return idemdriver.Claim{}, idem.ErrNotDue
		default:
			c, err = s.redriveTakeOver(ctx, p, cur, owner, at)
		}
		if err == nil {
			return c, nil
		}
		if !rowChanged(err) {
			return idemdriver.Claim{}, interpretError(err)
		}
		// Another claim, a Fail or a Release changed the row since we
		// read it: decide again.
	}
	return idemdriver.Claim{}, errContention
}

// rowChanged reports whether one of Claim's conditional autocommit
// statements (insert, takeOver, replace, redriveTakeOver) failed because
// the key's row changed under it: it matched no row (pgx.ErrNoRows), or,
// with the database's default isolation at REPEATABLE READ or
// SERIALIZABLE, it raised a serialization failure (40001) or a deadlock
// (40P01) against a concurrent claim. Each of these statements is its own
// transaction, so the error means it committed nothing: Claim reads the
// row and decides again.
func rowChanged(err error) bool {
	return errors.Is(err, pgx.ErrNoRows) || lostRace(err)
}

// noClaimFunction reports whether err says that the call of idem_claim
// found no function to run: PostgreSQL's 42883 (undefined_function), when
// the schema has no idem_claim yet or the idem_claim the call found does
// not claim in the store's table; or the internal error (XX000) of a call
// whose function was dropped between its lookup and its start, "cache
// lookup failed for function" (an untranslated message). Either way the
// call failed, and being an autocommit statement it committed nothing:
// the insert-or-read statement may claim instead.
func noClaimFunction(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return false
	}
	return pe.Code == "42883" ||
		pe.Code == "XX000" && strings.HasPrefix(pe.Message, "cache lookup failed for function ")
}

// lostRace reports whether err is a serialization failure (40001) or a
// deadlock (40P01): the database rolled the transaction back because a
// concurrent one changed what it read or wrote.
func lostRace(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == "40001" || pe.Code == "40P01")
}

// expiresIn is how long a record expiring at expiresAt has left at now,
// never negative.
func expiresIn(expiresAt, now time.Time) time.Duration {
	return max(0, expiresAt.Sub(now))
}

// leaseClaim scans what insert, takeOver and replace return: the lease's
// end, attempts, creation, the record's expiry and the statement's time.
func leaseClaim(row pgx.Row, p idemdriver.ClaimParams, owner string) (idemdriver.Claim, error) {
	l := &idemdriver.Lease{User: p.User, Key: p.Key, Owner: owner}
	var expiresAt, now time.Time
	if err := row.Scan(&l.Until, &l.Attempt, &l.CreatedAt, &expiresAt, &now); err != nil {
		return idemdriver.Claim{}, err
	}
	return idemdriver.Claim{Lease: l, ExpiresIn: expiresIn(expiresAt, now)}, nil
}

// insertOrReadSQL claims a free key, or reads the key's row, in one
// statement: the INSERT … ON CONFLICT DO NOTHING, and when it inserted
// nothing, the row it conflicted with, as readClaim reads it, with the
// statement's time. The row is read with the statement's snapshot, taken
// before the INSERT: a row that a concurrent claim committed while the
// INSERT waited for it is not visible, and the statement returns no row.
// The first column says which of the two it returned. Claims send it only
// on a schema without the function idem_claim (migration 0006), or whose
// idem_claim found by the call is not the table's; the function returns
// the same columns from the same two steps in a call PostgreSQL need not
// parse and plan each time (see the migration).
const insertOrReadSQL = `
WITH c AS (SELECT coalesce($11::timestamptz, statement_timestamp()) AS now),
ins AS (
	INSERT INTO idempotency_keys
		(user_id, key, fingerprint, method, path, request_header, request_body,
		 owner, lease_until, attempts, created_at, expires_at)
	SELECT $1, $2, $3, $4, $5, $6, $7, $8, c.now + $9::interval, 1, c.now, c.now + $10::interval
	FROM c
	ON CONFLICT (user_id, key) DO NOTHING
	RETURNING fingerprint, owner, lease_until, attempts, redrives, created_at, expires_at
)
SELECT true, ins.fingerprint, ins.owner, ins.lease_until, ins.attempts, ins.redrives, ins.created_at, ins.expires_at,
	NULL::int, NULL::jsonb, NULL::bytea, NULL::jsonb, c.now
FROM ins, c
UNION ALL
SELECT false, k.fingerprint, k.owner, k.lease_until, k.attempts, k.redrives, k.created_at, k.expires_at,
	k.response_status, k.response_header, k.response_body, k.response_trailer, c.now
FROM idempotency_keys k, c
WHERE k.user_id = $1 AND k.key = $2 AND NOT EXISTS (SELECT FROM ins)`

// insertOrRead claims a free key and returns its lease, or returns the
// key's row as readClaim does (a non-nil claimState) when the key exists.
// It returns pgx.ErrNoRows when the key exists but its row is not
// visible to the statement (see insertOrReadSQL).
func (s *Store) insertOrRead(ctx context.Context, p idemdriver.ClaimParams, header []byte, owner string, at *time.Time) (idemdriver.Claim, *claimState, error) {
	var (
		inserted bool
		c        claimState
		status   *int
		rheader  []byte
		respBdy  []byte
		trailer  []byte
	)
	statement := s.claimSQL
	if s.noClaimFunc.Load() {
		statement = s.q(insertOrReadSQL)
	}
	var err error
	for {
		err = s.pool.QueryRow(ctx, statement, s.mode,
			p.User, p.Key, p.Fingerprint, p.Method, p.Path, jsonText(header), p.Body,
			owner, p.Lease, p.TTL, at,
		).Scan(&inserted, &c.fingerprint, &c.owner, &c.leaseUntil, &c.attempts, &c.redrives, &c.createdAt, &c.expiresAt,
			&status, &rheader, &respBdy, &trailer, &c.now)
		if err != nil && statement == s.claimSQL && noClaimFunction(err) {
			// Nothing was claimed: no idem_claim here (or it was being
			// dropped), or one that refused the caller's table.
			s.noClaimFunc.Store(true)
			statement = s.q(insertOrReadSQL)
			continue
		}
		if err != nil {
			return idemdriver.Claim{}, nil, err
		}
		break
	}
	if inserted {
		l := &idemdriver.Lease{User: p.User, Key: p.Key, Owner: owner, Until: c.leaseUntil, Attempt: c.attempts, CreatedAt: c.createdAt}
		return idemdriver.Claim{Lease: l, ExpiresIn: expiresIn(c.expiresAt, c.now)}, nil, nil
	}
	c.response, err = responseOf(status, rheader, respBdy, trailer)
	if err != nil {
		return idemdriver.Claim{}, nil, err
	}
	return idemdriver.Claim{}, &c, nil
}

// claimState is what Claim reads to decide about an existing key, with
// the time it was read at.
type claimState struct {
	fingerprint string
	owner       string
	leaseUntil  time.Time
	attempts    int
	redrives    int
	createdAt   time.Time
	expiresAt   time.Time
	response    *idemdriver.Response
	now         time.Time
}

func (s *Store) readClaim(ctx context.Context, user, key string, at *time.Time) (*claimState, error) {
	var (
		c       claimState
		status  *int
		header  []byte
		respBdy []byte
		trailer []byte
	)
	err := s.pool.QueryRow(ctx, s.q(`
SELECT fingerprint, owner, lease_until, attempts, redrives, created_at, expires_at,
	response_status, response_header, response_body, response_trailer,
	coalesce($3::timestamptz, statement_timestamp())
FROM idempotency_keys
WHERE user_id = $1 AND key = $2`), s.mode,
		user, key, at,
	).Scan(&c.fingerprint, &c.owner, &c.leaseUntil, &c.attempts, &c.redrives, &c.createdAt, &c.expiresAt,
		&status, &header, &respBdy, &trailer, &c.now)
	if err != nil {
		return nil, err
	}
	c.response, err = responseOf(status, header, respBdy, trailer)
	if err != nil {
		return nil, err
	}
	return &c, nil
}

// record is the part of the record that c holds, for
// idemdriver.AbandonedParams.Due.
func (c *claimState) record(user, key string) *idemdriver.Record {
	return &idemdriver.Record{
		User: user, Key: key, Fingerprint: c.fingerprint, Owner: c.owner,
		LeaseUntil: c.leaseUntil, Attempts: c.attempts, Redrives: c.redrives,
		Response: c.response, CreatedAt: c.createdAt, ExpiresAt: c.expiresAt,
	}
}

// takeOver claims, for a client, a record without a response whose lease
// ran out, expired or not, if it is still the one read (owner oldOwner).
// The operation stays the same: created_at and expires_at are kept, and
// redrives too (a client's attempt is not a re-drive). It returns
// pgx.ErrNoRows if the record changed.
func (s *Store) takeOver(ctx context.Context, p idemdriver.ClaimParams, oldOwner, owner string, at *time.Time) (idemdriver.Claim, error) {
	return leaseClaim(s.pool.QueryRow(ctx, s.q(`
UPDATE idempotency_keys
SET owner = $4, lease_until = c.now + $5::interval, attempts = attempts + 1
FROM (SELECT coalesce($6::timestamptz, statement_timestamp()) AS now) c
WHERE user_id = $1 AND key = $2 AND owner = $3
	AND response_status IS NULL AND lease_until <= c.now
RETURNING lease_until, attempts, created_at, expires_at, c.now`), s.mode,
		p.User, p.Key, oldOwner, owner, p.Lease, at,
	), p, owner)
}

// redriveTakeOver is a completer's takeover of the record cur, read and
// found due: it matches only if the record is still exactly the one Due
// was decided on (the same owner, operation, lease end and re-drives, no
// response), and counts the attempt and the re-drive. It returns
// pgx.ErrNoRows if the record changed.
func (s *Store) redriveTakeOver(ctx context.Context, p idemdriver.ClaimParams, cur *claimState, owner string, at *time.Time) (idemdriver.Claim, error) {
	return leaseClaim(s.pool.QueryRow(ctx, s.q(`
UPDATE idempotency_keys
SET owner = $4, lease_until = c.now + $5::interval, attempts = attempts + 1, redrives = redrives + 1
FROM (SELECT coalesce($6::timestamptz, statement_timestamp()) AS now) c
WHERE user_id = $1 AND key = $2 AND owner = $3
	AND response_status IS NULL AND lease_until <= c.now
	AND created_at = $7 AND redrives = $8 AND lease_until = $9
RETURNING lease_until, attempts, created_at, expires_at, c.now`), s.mode,
		p.User, p.Key, cur.owner, owner, p.Lease, at, cur.createdAt, cur.redrives, cur.leaseUntil,
	), p, owner)
}

// replace turns a completed record whose expiry passed, if it is still the
// one read (owner oldOwner), into a new operation for p, with no re-drives
// yet. It returns pgx.ErrNoRows if the record changed.
func (s *Store) replace(ctx context.Context, p idemdriver.ClaimParams, header []byte, oldOwner, owner string, at *time.Time) (idemdriver.Claim, error) {
	return leaseClaim(s.pool.QueryRow(ctx, s.q(`
UPDATE idempotency_keys
SET fingerprint = $4, method = $5, path = $6, request_header = $7, request_body = $8,
	owner = $9, lease_until = c.now + $10::interval, attempts = 1, redrives = 0,
	response_status = NULL, response_header = NULL, response_body = NULL, response_trailer = NULL,
	created_at = c.now, completed_at = NULL, expires_at = c.now + $11::interval
FROM (SELECT coalesce($12::timestamptz, statement_timestamp()) AS now) c
WHERE user_id = $1 AND key = $2 AND owner = $3
	AND response_status IS NOT NULL AND expires_at <= c.now
RETURNING lease_until, attempts, created_at, expires_at, c.now`), s.mode,
		p.User, p.Key, oldOwner,
		p.Fingerprint, p.Method, p.Path, jsonText(header), p.Body,
		owner, p.Lease, p.TTL, at,
	), p, owner)
}

// Release implements idem.Store.
func (s *Store) Release(ctx context.Context, l *idemdriver.Lease) error {
	tag, err := s.pool.Exec(ctx, s.q(`
DELETE FROM idempotency_keys
WHERE user_id = $1 AND key = $2 AND owner = $3 AND response_status IS NULL`), s.mode,
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
func (s *Store) Fail(ctx context.Context, l *idemdriver.Lease) error {
	tag, err := s.pool.Exec(ctx, s.q(`
UPDATE idempotency_keys SET lease_until = coalesce($4::timestamptz, statement_timestamp())
WHERE user_id = $1 AND key = $2 AND owner = $3 AND response_status IS NULL`), s.mode,
		l.User, l.Key, l.Owner, s.at())
	if err != nil {
		return interpretError(err)
	}
	if tag.RowsAffected() == 0 {
		return idem.ErrFenced
	}
	return nil
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
