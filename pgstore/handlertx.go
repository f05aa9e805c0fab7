package pgstore

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// handlerTx is the pgx.Tx that handlers get (FromContext, PgxTx). Its
// transaction begins with the handler's first statement: Exec, Query and
// QueryRow send BEGIN and the statement in one round trip (pgx's
// Batch.BeginTx); the other methods (a savepoint's Begin, CopyFrom,
// SendBatch, Prepare, LargeObjects, Conn, Commit, Rollback) begin it
// first in a round trip of its own. A handler that runs no statement
// opens no transaction at all: Complete then runs the completion alone.
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

// begin returns the transaction, beginning it in a round trip of its own
// if no statement began it yet.
func (h handlerTx) begin(ctx context.Context) (pgx.Tx, error) {
	t := h.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return nil, pgx.ErrTxClosed
	}
	if t.tx == nil {
		tx, err := t.conn.Conn().BeginTx(ctx, t.s.txOptions)
		if err != nil {
			return nil, err
		}
		t.tx = tx
	}
	return t.tx, nil
}

// batch sends the statement q with its arguments: alone if the
// transaction began, after BEGIN in the same round trip otherwise. It
// returns nil results (and no error) when the transaction began; with
// results, the BEGIN's result was read and the statement's is next.
func (h handlerTx) batch(ctx context.Context, sql string, args []any) (pgx.Tx, pgx.BatchResults, error) {
	t := h.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return nil, nil, pgx.ErrTxClosed
	}
	if t.tx != nil {
		return t.tx, nil, nil
	}
	b := &pgx.Batch{}
	b.BeginTx(t.s.txOptions)
	b.Queue(sql, args...)
	br := t.conn.Conn().SendBatch(ctx, b)
	t.tx = br.Tx() // closed if the BEGIN fails: later statements fail too
	if _, err := br.Exec(); err != nil {
		br.Close()
		return nil, nil, err
	}
	return nil, br, nil
}

func (h handlerTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tx, br, err := h.batch(ctx, sql, args)
	switch {
	case err != nil:
		return pgconn.CommandTag{}, err
	case br == nil:
		return tx.Exec(ctx, sql, args...)
	}
	tag, err := br.Exec()
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return tag, err
}

func (h handlerTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	tx, br, err := h.batch(ctx, sql, args)
	switch {
	case err != nil:
		return closedRows{err}, err
	case br == nil:
		return tx.Query(ctx, sql, args...)
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
	tx, br, err := h.batch(ctx, sql, args)
	switch {
	case err != nil:
		return closedRows{err}
	case br == nil:
		return tx.QueryRow(ctx, sql, args...)
	}
	return batchRow{row: br.QueryRow(), br: br}
}

func (h handlerTx) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := h.begin(ctx)
	if err != nil {
		return nil, err
	}
	nested, err := tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &guardedTx{Tx: nested, t: h.t}, nil
}

func (h handlerTx) Commit(ctx context.Context) error {
	tx, err := h.begin(ctx)
	if err != nil {
		return err
	}
	return tx.Commit(ctx)
}

func (h handlerTx) Rollback(ctx context.Context) error {
	tx, err := h.begin(ctx)
	if err != nil {
		return err
	}
	return tx.Rollback(ctx)
}

func (h handlerTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	tx, err := h.begin(ctx)
	if err != nil {
		return 0, err
	}
	return tx.CopyFrom(ctx, table, columns, src)
}

func (h handlerTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	tx, err := h.begin(ctx)
	if err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return tx.SendBatch(ctx, b)
}

func (h handlerTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	tx, err := h.begin(ctx)
	if err != nil {
		return nil, err
	}
	return tx.Prepare(ctx, name, sql)
}

// LargeObjects begins the transaction, without a context (pgx.Tx's
// method has none), if no statement began it yet. If it cannot, the large
// objects' methods fail with pgx.ErrTxClosed.
func (h handlerTx) LargeObjects() pgx.LargeObjects {
	tx, err := h.open()
	if err != nil {
		return closedTx().LargeObjects()
	}
	return tx.LargeObjects()
}

// Conn begins the transaction as LargeObjects does, and returns its
// connection: nil once the Tx ended or if the transaction cannot begin.
func (h handlerTx) Conn() *pgx.Conn {
	tx, err := h.open()
	if err != nil {
		return nil
	}
	return tx.Conn()
}

// open is begin for the methods without a context. If the Tx has not
// ended and the BEGIN fails, it closes the connection, so that nothing
// can run on it outside the transaction.
func (h handlerTx) open() (pgx.Tx, error) {
	ctx := context.Background()
	tx, err := h.begin(ctx)
	if err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		h.t.conn.Conn().Close(ctx)
	}
	return tx, err
}

// closedTx returns a pgx.Tx that is closed: its methods fail with
// pgx.ErrTxClosed.
func closedTx() pgx.Tx {
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	return pgx.FailedBatchResults(b, pgx.ErrTxClosed).Tx()
}

// guardedTx is a savepoint's transaction, refused once its Tx ended.
type guardedTx struct {
	pgx.Tx
	t *Tx
}

func (g *guardedTx) ended() bool {
	g.t.mu.Lock()
	defer g.t.mu.Unlock()
	return g.t.done
}

func (g *guardedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if g.ended() {
		return nil, pgx.ErrTxClosed
	}
	nested, err := g.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return &guardedTx{Tx: nested, t: g.t}, nil
}

func (g *guardedTx) Commit(ctx context.Context) error {
	if g.ended() {
		return pgx.ErrTxClosed
	}
	return g.Tx.Commit(ctx)
}

func (g *guardedTx) Rollback(ctx context.Context) error {
	if g.ended() {
		return pgx.ErrTxClosed
	}
	return g.Tx.Rollback(ctx)
}

func (g *guardedTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	if g.ended() {
		return 0, pgx.ErrTxClosed
	}
	return g.Tx.CopyFrom(ctx, table, columns, src)
}

func (g *guardedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if g.ended() {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return g.Tx.SendBatch(ctx, b)
}

func (g *guardedTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if g.ended() {
		return nil, pgx.ErrTxClosed
	}
	return g.Tx.Prepare(ctx, name, sql)
}

func (g *guardedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if g.ended() {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return g.Tx.Exec(ctx, sql, args...)
}

func (g *guardedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if g.ended() {
		return closedRows{pgx.ErrTxClosed}, pgx.ErrTxClosed
	}
	return g.Tx.Query(ctx, sql, args...)
}

func (g *guardedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if g.ended() {
		return closedRows{pgx.ErrTxClosed}
	}
	return g.Tx.QueryRow(ctx, sql, args...)
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
