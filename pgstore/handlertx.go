package pgstore

import (
	"context"
	"errors"
	"fmt"

	"github.com/idem-go/idem"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// handlerTx is the pgx.Tx that handlers get (FromContext, PgxTx). Its
// transaction begins with the handler's first statement: Exec, Query and
// QueryRow send BEGIN and the statement in one round trip (pgx's
// Batch.BeginTx); the other methods (a savepoint's Begin, CopyFrom,
// SendBatch, Prepare, LargeObjects, Conn) begin it first in a round trip
// of its own. A handler that runs no statement opens no transaction at
// all: Complete then runs the completion alone.
//
// Commit and Rollback refuse (idem.ErrTxOwned) and change nothing: the
// middleware commits the transaction with the stored answer (Complete),
// or rolls it back. A savepoint's transaction (Begin) commits and rolls
// back as pgx's does: that releases or rolls back to the savepoint, and
// the request's transaction stays open. COMMIT or ROLLBACK sent as SQL
// (through Exec, or on Conn's connection) is not caught here: Complete
// then finds the transaction closed and stores nothing (errTxNotOpen),
// the attempt fails, and a retry runs the handler again, after what it
// committed on its own.
//
// Once the Tx ended (Complete or Rollback) every method fails with
// pgx.ErrTxClosed: Complete commits in the same round trip as the
// completion, past pgx's own transaction object, and gives the
// connection back to the pool, so a handler that kept the pgx.Tx (a
// goroutine that outlived its request, say) must fail rather than run its
// statements on a connection that another request uses. A savepoint's
// transaction (Begin) shares that guard.
type handlerTx struct {
	t *Tx
}

var _ pgx.Tx = handlerTx{}

// locked runs f on the transaction, holding t.mu, after beginning the
// transaction in a round trip of its own if no statement began it yet.
func (h handlerTx) locked(ctx context.Context, f func(pgx.Tx) error) error {
	t := h.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return pgx.ErrTxClosed
	}
	if t.tx == nil {
		if err := h.begin(ctx); err != nil {
			return err
		}
	}
	return f(t.tx)
}

// begin begins the transaction in a round trip of its own. The caller
// holds t.mu, and t.tx is nil.
func (h handlerTx) begin(ctx context.Context) error {
	tx, err := h.t.conn.Conn().BeginTx(ctx, h.t.s.txOptions)
	if err != nil {
		return err
	}
	h.t.tx = tx
	return nil
}

// hasQueryOptions reports whether a statement's arguments begin with
// one of pgx's query options (a QueryExecMode, QueryResultFormats or
// QueryResultFormatsByOID), which a batch does not take: such a statement
// is sent after a BEGIN of its own, as pgx.Tx would send it.
func hasQueryOptions(args []any) bool {
	if len(args) == 0 {
		return false
	}
	switch args[0].(type) {
	case pgx.QueryExecMode, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID:
		return true
	}
	return false
}

// batch sends the statement sql with its arguments after BEGIN, in one
// round trip, and reads the BEGIN's result: the statement's is next. The
// caller holds t.mu, and t.tx is nil.
func (h handlerTx) batch(ctx context.Context, sql string, args []any) (pgx.BatchResults, error) {
	t := h.t
	b := &pgx.Batch{}
	b.BeginTx(t.s.txOptions)
	b.Queue(sql, args...)
	br := t.conn.Conn().SendBatch(ctx, b)
	t.tx = br.Tx() // closed if the BEGIN fails: later statements fail too
	if _, err := br.Exec(); err != nil {
		br.Close()
		return nil, err
	}
	return br, nil
}

// The statements hold t.mu until they were sent (Query and QueryRow: until
// the first result arrived), so that Complete and Rollback, which take it
// too, never give the connection back to the pool while a statement of a
// handler's goroutine is on its way: that statement would run in another
// request's transaction, or on its own.

func (h handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	t := h.t
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.done:
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	case t.tx == nil && hasQueryOptions(args):
		if err := h.begin(ctx); err != nil {
			return pgconn.CommandTag{}, err
		}
		return t.tx.Exec(ctx, sql, args...)
	case t.tx != nil:
		return t.tx.Exec(ctx, sql, args...)
	}
	br, err := h.batch(ctx, sql, args)
	if err != nil {
		return pgconn.CommandTag{}, err
	}
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tag, err
}

func (h handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	t := h.t
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.done:
		return closedRows{pgx.ErrTxClosed}, pgx.ErrTxClosed
	case t.tx == nil && hasQueryOptions(args):
		if err := h.begin(ctx); err != nil {
			return closedRows{err}, err
		}
		return t.tx.Query(ctx, sql, args...)
	case t.tx != nil:
		return t.tx.Query(ctx, sql, args...)
	}
	br, err := h.batch(ctx, sql, args)
	if err != nil {
		return closedRows{err}, err
	}
	rows, err := br.Query()
	if err != nil {
		rows.Close()
		br.Close()
		return rows, err
	}
	return batchRows{Rows: rows, br: br}, nil
}

func (h handlerTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	t := h.t
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.done:
		return closedRows{pgx.ErrTxClosed}
	case t.tx == nil && hasQueryOptions(args):
		if err := h.begin(ctx); err != nil {
			return closedRows{err}
		}
		return t.tx.QueryRow(ctx, sql, args...)
	case t.tx != nil:
		return t.tx.QueryRow(ctx, sql, args...)
	}
	br, err := h.batch(ctx, sql, args)
	if err != nil {
		return closedRows{err}
	}
	return batchRow{row: br.QueryRow(), br: br}
}

func (h handlerTx) Begin(ctx context.Context) (pgx.Tx, error) {
	var nested pgx.Tx
	err := h.locked(ctx, func(tx pgx.Tx) (err error) {
		nested, err = tx.Begin(ctx)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &guardedTx{Tx: nested, t: h.t}, nil
}

// Commit refuses with an error matching idem.ErrTxOwned and changes
// nothing, not even beginning the transaction: the middleware commits
// it, with the stored answer, once the handler returned.
func (handlerTx) Commit(context.Context) error {
	return fmt.Errorf("pgstore: Commit from the handler: %w", idem.ErrTxOwned)
}

// Rollback refuses as Commit does: the middleware rolls the transaction
// back when the handler's answer is not stored. A handler that wants to
// undo part of its work does it in a savepoint (Begin).
func (handlerTx) Rollback(context.Context) error {
	return fmt.Errorf("pgstore: Rollback from the handler: %w", idem.ErrTxOwned)
}

func (h handlerTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (n int64, err error) {
	err = h.locked(ctx, func(tx pgx.Tx) error {
		n, err = tx.CopyFrom(ctx, table, columns, src)
		return err
	})
	return n, err
}

func (h handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) (br pgx.BatchResults) {
	err := h.locked(ctx, func(tx pgx.Tx) error {
		br = tx.SendBatch(ctx, b)
		return nil
	})
	if err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return br
}

func (h handlerTx) Prepare(ctx context.Context, name, sql string) (sd *pgconn.StatementDescription, err error) {
	err = h.locked(ctx, func(tx pgx.Tx) error {
		sd, err = tx.Prepare(ctx, name, sql)
		return err
	})
	return sd, err
}

// LargeObjects begins the transaction, without a context (pgx.Tx's
// method has none), if no statement began it yet. If it cannot, the large
// objects' methods fail with pgx.ErrTxClosed. The large objects reach the
// connection past this pgx.Tx's guard, so the Tx closes the connection
// when it ends, rather than give it back to the pool (see Tx.giveBack):
// used after the end, their methods fail.
func (h handlerTx) LargeObjects() pgx.LargeObjects {
	tx, err := h.open()
	if err != nil {
		return closedTx().LargeObjects()
	}
	return tx.LargeObjects()
}

// Conn begins the transaction as LargeObjects does, and returns its
// connection: nil once the Tx ended or if the transaction cannot begin.
// The connection is raw: COMMIT or ROLLBACK executed on it as SQL is not
// refused as Commit and Rollback are (see handlerTx). The handler must
// not send them. The Tx closes it when it ends, as for LargeObjects.
func (h handlerTx) Conn() *pgx.Conn {
	tx, err := h.open()
	if err != nil {
		return nil
	}
	return tx.Conn()
}

// open begins the transaction for the methods without a context. If the
// Tx has not ended and the BEGIN fails, it closes the connection, so that
// nothing can run on it outside the transaction.
func (h handlerTx) open() (pgx.Tx, error) {
	ctx := context.Background()
	var open pgx.Tx
	err := h.locked(ctx, func(tx pgx.Tx) error {
		open = tx
		h.t.raw = true // a handle past the guard: see Tx.giveBack
		return nil
	})
	if err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		h.t.conn.Conn().Close(ctx)
	}
	return open, err
}

// closedTx returns a pgx.Tx that is closed: its methods fail with
// pgx.ErrTxClosed.
func closedTx() pgx.Tx {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	return pgx.FailedBatchResults(b, pgx.ErrTxClosed).Tx()
}

// guardedTx is a savepoint's transaction, refused once its Tx ended; its
// statements hold the Tx's mutex as handlerTx's do.
type guardedTx struct {
	pgx.Tx
	t *Tx
}

// locked runs f holding the Tx's mutex, unless the Tx ended.
func (g *guardedTx) locked(f func() error) error {
	g.t.mu.Lock()
	defer g.t.mu.Unlock()
	if g.t.done {
		return pgx.ErrTxClosed
	}
	return f()
}

func (g *guardedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	var nested pgx.Tx
	err := g.locked(func() (err error) {
		nested, err = g.Tx.Begin(ctx)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &guardedTx{Tx: nested, t: g.t}, nil
}

// LargeObjects is the savepoint's, which reaches the connection past
// the guard: the Tx closes the connection when it ends (see
// Tx.giveBack). Once the Tx ended, the large objects' methods fail with
// pgx.ErrTxClosed.
func (g *guardedTx) LargeObjects() pgx.LargeObjects {
	lo := closedTx().LargeObjects()
	_ = g.locked(func() error { // ended: lo stays the closed one
		g.t.raw = true
		lo = g.Tx.LargeObjects()
		return nil
	})
	return lo
}

// Conn returns the transaction's connection, as handlerTx.Conn does:
// nil once the Tx ended.
func (g *guardedTx) Conn() *pgx.Conn {
	var c *pgx.Conn
	_ = g.locked(func() error { // ended: c stays nil
		g.t.raw = true
		c = g.Tx.Conn()
		return nil
	})
	return c
}

func (g *guardedTx) Commit(ctx context.Context) error {
	return g.locked(func() error { return g.Tx.Commit(ctx) })
}

func (g *guardedTx) Rollback(ctx context.Context) error {
	return g.locked(func() error { return g.Tx.Rollback(ctx) })
}

func (g *guardedTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (n int64, err error) {
	err = g.locked(func() error {
		n, err = g.Tx.CopyFrom(ctx, table, columns, src)
		return err
	})
	return n, err
}

func (g *guardedTx) SendBatch(ctx context.Context, b *pgx.Batch) (br pgx.BatchResults) {
	if err := g.locked(func() error { br = g.Tx.SendBatch(ctx, b); return nil }); err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return br
}

func (g *guardedTx) Prepare(ctx context.Context, name, sql string) (sd *pgconn.StatementDescription, err error) {
	err = g.locked(func() error {
		sd, err = g.Tx.Prepare(ctx, name, sql)
		return err
	})
	return sd, err
}

func (g *guardedTx) Exec(ctx context.Context, sql string, args ...any) (tag pgconn.CommandTag, err error) {
	err = g.locked(func() error {
		tag, err = g.Tx.Exec(ctx, sql, args...)
		return err
	})
	return tag, err
}

func (g *guardedTx) Query(ctx context.Context, sql string, args ...any) (rows pgx.Rows, err error) {
	err = g.locked(func() error {
		rows, err = g.Tx.Query(ctx, sql, args...)
		return err
	})
	if rows == nil {
		rows = closedRows{err}
	}
	return rows, err
}

func (g *guardedTx) QueryRow(ctx context.Context, sql string, args ...any) (row pgx.Row) {
	if err := g.locked(func() error { row = g.Tx.QueryRow(ctx, sql, args...); return nil }); err != nil {
		return closedRows{err}
	}
	return row
}

// batchRows are the rows of a statement sent after BEGIN: closing them
// closes the batch.
type batchRows struct {
	pgx.Rows
	br pgx.BatchResults
}

func (r batchRows) Close() {
	r.Rows.Close()
	r.br.Close()
}

// batchRow is the row of a statement sent after BEGIN: scanning it closes
// the batch.
type batchRow struct {
	row pgx.Row
	br  pgx.BatchResults
}

func (r batchRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	if cerr := r.br.Close(); err == nil {
		err = cerr
	}
	return err
}

// closedRows is the answer of Query and QueryRow that could not be sent:
// no row, and the error.
type closedRows struct{ err error }

func (closedRows) Close()                                       {}
func (r closedRows) Err() error                                 { return r.err }
func (closedRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (closedRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (closedRows) Next() bool                                   { return false }
func (r closedRows) Scan(...any) error                          { return r.err }
func (r closedRows) Values() ([]any, error)                     { return nil, r.err }
func (closedRows) RawValues() [][]byte                          { return nil }
func (closedRows) Conn() *pgx.Conn                              { return nil }
func (closedRows) TypeMap() *pgtype.Map                         { return nil }
