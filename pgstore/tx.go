package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Tx is the transaction in which a handler writes and in which its outcome
// commits. Handlers reach it with FromContext (or PgxTx); the middleware
// calls Complete or Rollback.
type Tx struct {
	s     *Store
	lease *idemdriver.Lease
	conn  *pgxpool.Conn // the pool's connection, released when the Tx ends

	mu   sync.Mutex // guards tx, done, raw and given
	tx   pgx.Tx     // the transaction on conn; nil until the handler's first statement (see handlerTx)
	done bool       // Complete or Rollback was called: the handler's pgx.Tx refuses statements
	// raw: the handler took a handle that reaches conn past the guard of
	// its pgx.Tx (LargeObjects, Conn, or a savepoint's), which a
	// goroutine may still use once the Tx ended: conn is then closed
	// rather than given back to the pool (see giveBack).
	raw   bool
	given bool // conn was given back to the pool (or closed)
}

// Begin implements idem.Store: it takes a connection from the pool for a
// database transaction with Options.TxOptions, which begins with the
// handler's first statement, sent in the same round trip as BEGIN (see
// PgxTx). It does not touch the key's row, so the transaction holds no
// lock that a Claim could wait on until Complete.
func (s *Store) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return nil, interpretError(err)
	}
	return &Tx{s: s, lease: l, conn: conn}, nil
}

// PgxTx returns the database transaction, for the handler's writes. The
// handler must not commit or roll it back. The transaction begins with
// its first statement: Exec, Query and QueryRow send BEGIN with the
// statement, in one round trip; its other methods begin it first. Once
// the Tx ended (Complete or Rollback), every method fails with
// pgx.ErrTxClosed.
func (tx *Tx) PgxTx() pgx.Tx { return handlerTx{tx} }

// FromContext returns the database transaction of the claimed request that
// ctx belongs to, beginning it on first use; a wrapper's transaction (see
// idemdriver.UnwrapTx) is unwrapped. Outside a claimed request it returns
// idem.ErrNoTx; after the request was answered, idem.ErrSettled; when
// the request's store is not a pgstore.Store, idem.ErrForeignTx.
func FromContext(ctx context.Context) (pgx.Tx, error) {
	tx, err := idem.TxFromContext(ctx)
	if err != nil {
		return nil, err
	}
	ptx, ok := idemdriver.UnwrapTx(tx).(*Tx)
	if !ok {
		return nil, fmt.Errorf("%w: %T", idem.ErrForeignTx, tx)
	}
	return handlerTx{ptx}, nil
}

// Complete implements idem.Tx. The fenced UPDATE (or, with resp nil,
// DELETE) of the key's row is the transaction's last statement, and it is
// sent with the COMMIT in one round trip, as one simple-protocol query
// (see completeQuery); when the handler ran no statement, it runs alone,
// as an autocommit statement. Either way the row stays locked only for
// the commit itself. The completion's time is
// the database's statement_timestamp() (see Clocks in the package
// documentation). A record whose expiry passed while its attempt ran is
// kept for its TTL again from the completion (expires_at = now +
// (expires_at - created_at), counted in microseconds, so that a day is 24
// hours in every time zone), so the client's retry replays the answer
// instead of starting a new operation. If the lease was taken over the
// completion matches no row and raises (see fenced), so that the COMMIT
// sent with it is not carried out: Complete rolls back and returns
// idem.ErrFenced. A second Complete, or one after Rollback, returns
// idem.ErrFenced too.
func (tx *Tx) Complete(ctx context.Context, resp *idemdriver.Response) error {
	tx.mu.Lock()
	defer tx.mu.Unlock()
	if tx.done {
		return idem.ErrFenced
	}
	tx.done = true
	defer tx.giveBack() // the pool closes the connection if a transaction is left on it
	l := tx.lease
	var (
		completion string
		args       []any // the query mode first: see completeQuery
	)
	if resp == nil {
		completion = fenced(tx.s.q(`
DELETE FROM idempotency_keys
WHERE user_id = $1 AND key = $2 AND owner = $3 AND response_status IS NULL`))
		args = []any{pgx.QueryExecModeSimpleProtocol, l.User, l.Key, l.Owner}
	} else {
		header, err := marshalHeader(resp.Header)
		var trailer []byte // NULL without trailers
		if err == nil && len(resp.Trailer) > 0 {
			trailer, err = marshalHeader(resp.Trailer)
		}
		if err != nil {
			tx.rollback(ctx)
			return interpretError(err)
		}
		completion = fenced(tx.s.q(`
UPDATE idempotency_keys
SET response_status = $4, response_header = $5, response_body = $6, response_trailer = $8, completed_at = c.now,
	request_body = NULL,
	expires_at = CASE WHEN expires_at > c.now THEN expires_at
		ELSE c.now + interval '1 microsecond' * (extract(epoch FROM expires_at - created_at) * 1000000) END
FROM (SELECT coalesce($7::timestamptz, statement_timestamp()) AS now) c
WHERE user_id = $1 AND key = $2 AND owner = $3 AND response_status IS NULL`))
		args = []any{pgx.QueryExecModeSimpleProtocol, l.User, l.Key, l.Owner, resp.Status, jsonText(header), resp.Body, tx.s.at(), jsonText(trailer)}
	}
	c := tx.conn.Conn()
	oneQuery := simpleProtocolAllowed(c.PgConn())
	if !oneQuery {
		// pgx writes arguments into a query's text only on a session
		// whose client_encoding is UTF8 (see simpleProtocolAllowed):
		// the completion goes in the extended protocol, and the COMMIT
		// in a round trip of its own.
		args[0] = tx.s.extendedMode()
	}
	var err error
	switch {
	case tx.tx == nil:
		// The handler ran no statement: no transaction to commit.
		_, err = c.Exec(ctx, completion, args...)
	case c.PgConn().TxStatus() == 'I':
		// The transaction is no longer open: the handler ended it itself
		// (COMMIT or ROLLBACK, which it must not do), or its BEGIN failed.
		// Its writes are committed or gone, and the answer cannot commit
		// with them. Store nothing.
		return errTxNotOpen
	default:
		var tag pgconn.CommandTag
		if oneQuery {
			tag, err = c.Exec(ctx, completion+";\nCOMMIT", args...)
		} else if _, err = c.Exec(ctx, completion, args...); err == nil {
			tag, err = c.Exec(ctx, "COMMIT") // no arguments: a simple query, sent as it is
		}
		if err == nil && tag.String() != "COMMIT" {
			err = pgx.ErrTxCommitRollback
		}
		if err != nil && tx.conn.Conn().PgConn().TxStatus() != 'I' {
			// The completion failed, so the COMMIT was not carried
			// out: the transaction waits for its ROLLBACK.
			if rerr := tx.rollback(ctx); rerr != nil && isFenced(err) {
				return errors.Join(idem.ErrFenced, interpretError(rerr))
			}
		}
	}
	switch {
	case err == nil:
		return nil
	case isFenced(err):
		return idem.ErrFenced
	}
	return tx.aborted(ctx, err)
}

// errTxNotOpen is Complete's error when the request's transaction is no
// longer open at the completion.
var errTxNotOpen = errors.New("pgstore: the request's transaction is not open at its completion (the handler committed or rolled it back, or its BEGIN failed); the answer is not stored")

// rollback rolls back the transaction, if one began.
func (tx *Tx) rollback(ctx context.Context) error {
	if tx.tx == nil {
		return nil
	}
	return tx.tx.Rollback(context.WithoutCancel(ctx))
}

// completeQuery: why the completion and its COMMIT are one query of the
// simple protocol, their arguments written into its text by pgx, rather
// than two statements of a pipeline. PostgreSQL executes each statement
// of a pipeline as soon as its Execute message arrives and commits at
// the COMMIT: if the connection stalled between the two (a network
// partition in the middle of the write), the completion's row lock would
// be held by a session that is not idle in its transaction, which
// idle_in_transaction_session_timeout does not end, and every claim of
// the key would wait for it until TCP gives up. One query message is
// executed only once it arrived whole; until then the session is idle in
// its transaction and the timeout applies. The header and trailer are
// passed as text (jsonText), which the simple protocol quotes as a
// string literal, for the jsonb columns.

//
// pgx writes arguments into a simple-protocol query only on a session
// whose client_encoding is UTF8 and standard_conforming_strings on
// (quoting is then safe whatever the text). A pool that leaves
// client_encoding to the database (a database created SQL_ASCII or
// LATIN1, as initdb or pg_autoctl make it under the C locale) has
// neither guarantee, and pgx refuses the query: there, the completion is
// sent in the extended protocol and the COMMIT after it, in a round trip
// of its own, so that completions work on any database; only the
// partition case above is then weaker (the row lock is held until TCP
// gives up). Every pool that the order service and the gateway build sets
// client_encoding=UTF8, and so should an application's (pgx assumes UTF8
// for every string it sends anyway).

// simpleProtocolAllowed reports whether pgx writes arguments into a
// simple-protocol query on c's session.
func simpleProtocolAllowed(c *pgconn.PgConn) bool {
	return c.ParameterStatus("client_encoding") == "UTF8" && c.ParameterStatus("standard_conforming_strings") == "on"
}

// extendedMode is the mode of a completion that cannot be one simple
// query: the store's, unless that is the simple protocol.
func (s *Store) extendedMode() pgx.QueryExecMode {
	if s.mode == pgx.QueryExecModeSimpleProtocol {
		return pgx.QueryExecModeExec
	}
	return s.mode
}

// jsonText is a marshalled header as the text of a jsonb value, or nil
// (SQL NULL) for nil.
func jsonText(b []byte) *string {
	if b == nil {
		return nil
	}
	s := string(b)
	return &s
}

// fencedMarker is the text of the error that a completion raises when it
// matched no row: the lease was taken over, or the record is gone.
const fencedMarker = "idem: fenced: the lease was taken over or the record is gone"

// fenced wraps a completion (an UPDATE or DELETE of the key's row, fenced
// on its owner) so that it raises when it matches no row. The COMMIT sent
// in the same round trip is then skipped by the database, which discards
// every statement after an error until the batch ends, and the
// transaction is rolled back. PostgreSQL has no function that raises an
// error, so the statement casts fencedMarker to an integer, which fails
// with SQLSTATE 22P02 and the marker in its message; the cast is applied
// to a CASE on the row count, which the planner cannot fold, so it runs
// only when no row matched.
func fenced(completion string) string {
	return `WITH done AS (` + completion + `
RETURNING 1)
SELECT (CASE WHEN count(*) = 0 THEN '` + fencedMarker + `' END)::int FROM done`
}

// isFenced reports whether err is the error fenced's statement raises.
func isFenced(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "22P02" && strings.Contains(pe.Message, fencedMarker)
}

// aborted is Complete's error when the completion or its COMMIT failed.
// With the database's default isolation at REPEATABLE READ or
// SERIALIZABLE, the fenced UPDATE of a row that another claim took over
// after the transaction's snapshot raises a serialization failure instead
// of matching no row, and SERIALIZABLE may refuse the COMMIT for the same
// reason. Both rolled everything back; the key's row, read again in a
// statement of its own, tells which case it was: owned by another attempt
// (or gone) is idem.ErrFenced, as under READ COMMITTED; still this
// attempt's, the error is returned as it is, and the middleware fails the
// attempt. Any other error is returned as it is: a COMMIT whose answer
// was lost may have committed, and only the record can say.
func (tx *Tx) aborted(ctx context.Context, err error) error {
	if !lostRace(err) {
		return interpretError(err)
	}
	l := tx.lease
	// Read on the Tx's own connection when the rollback left it idle, so
	// that a Complete never waits for a second connection of the pool
	// (all of them could be held by such Completes); on the pool once the
	// Tx's connection was given back otherwise.
	var q interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	} = tx.conn.Conn()
	if tx.conn.Conn().IsClosed() || tx.conn.Conn().PgConn().TxStatus() != 'I' {
		tx.giveBack() // the pool destroys it: it is closed or not idle
		q = tx.s.pool
	}
	var owner string
	switch qerr := q.QueryRow(context.WithoutCancel(ctx),
		tx.s.q(`SELECT owner FROM idempotency_keys WHERE user_id = $1 AND key = $2`), tx.s.mode, l.User, l.Key).Scan(&owner); {
	case errors.Is(qerr, pgx.ErrNoRows), qerr == nil && owner != l.Owner:
		return fmt.Errorf("%w (%w)", idem.ErrFenced, interpretError(err))
	}
	return interpretError(err)
}

// Rollback implements idem.Tx. It is a no-op after Complete or a first
// Rollback.
func (tx *Tx) Rollback(ctx context.Context) error {
	tx.mu.Lock()
	defer tx.mu.Unlock()
	if tx.done {
		return nil
	}
	tx.done = true
	defer tx.giveBack()
	if err := tx.rollback(ctx); err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		return interpretError(err)
	}
	return nil
}

// giveBack gives the Tx's connection back to the pool, once. If the
// handler took a handle that reaches the connection past its pgx.Tx's
// guard (LargeObjects, Conn, or a savepoint's), the connection is closed
// first, and the pool drops it: pgx's transaction object, which those
// handles use, stays open after Complete (which commits past it), so a
// goroutine the handler left running would otherwise run its statements
// on a connection that another request holds, or on its own. The caller
// holds tx.mu.
func (tx *Tx) giveBack() {
	if tx.given {
		return
	}
	tx.given = true
	if tx.raw {
		ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
		tx.conn.Conn().Close(ctx) // the network connection is closed whatever the error
		cancel()
	}
	tx.conn.Release()
}

// closeTimeout bounds the clean close (Terminate) of a connection that
// giveBack closes.
const closeTimeout = time.Second
