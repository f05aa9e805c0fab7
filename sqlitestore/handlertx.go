package sqlitestore

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/idem-go/idem"
)

// HandlerTx is the request's database transaction as the handler gets it
// (FromContext, Tx.SQL): the statement methods of *sql.Tx, and Commit and
// Rollback that refuse. The middleware owns the transaction: it commits
// the handler's writes together with the stored answer, or rolls them
// back, once the handler returned; a handler that committed them itself
// would leave its key without an answer, and its next attempt would run
// it again.
//
// It has what *sql.Tx and *sql.DB share, so code that writes through
// either takes an interface of those methods (ExecContext, QueryContext,
// QueryRowContext) and is handed a HandlerTx inside a request. COMMIT or
// ROLLBACK sent as SQL (ExecContext) is not refused; the handler must not
// send them.
type HandlerTx struct {
	tx *sql.Tx
}

// Commit refuses with an error matching idem.ErrTxOwned and changes
// nothing: the transaction stays open, and what the handler wrote
// commits with its answer.
func (*HandlerTx) Commit() error {
	return fmt.Errorf("sqlitestore: Commit from the handler: %w", idem.ErrTxOwned)
}

// Rollback refuses as Commit does. A handler that wants to undo part of
// its work does it in a savepoint (SAVEPOINT, ROLLBACK TO, RELEASE).
func (*HandlerTx) Rollback() error {
	return fmt.Errorf("sqlitestore: Rollback from the handler: %w", idem.ErrTxOwned)
}

// ExecContext is (*sql.Tx).ExecContext.
func (h *HandlerTx) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	return h.tx.ExecContext(ctx, query, args...)
}

// Exec is (*sql.Tx).Exec.
func (h *HandlerTx) Exec(query string, args ...any) (sql.Result, error) {
	return h.tx.Exec(query, args...)
}

// QueryContext is (*sql.Tx).QueryContext.
func (h *HandlerTx) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	return h.tx.QueryContext(ctx, query, args...)
}

// Query is (*sql.Tx).Query.
func (h *HandlerTx) Query(query string, args ...any) (*sql.Rows, error) {
	return h.tx.Query(query, args...)
}

// QueryRowContext is (*sql.Tx).QueryRowContext.
func (h *HandlerTx) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	return h.tx.QueryRowContext(ctx, query, args...)
}

// QueryRow is (*sql.Tx).QueryRow.
func (h *HandlerTx) QueryRow(query string, args ...any) *sql.Row {
	return h.tx.QueryRow(query, args...)
}

// PrepareContext is (*sql.Tx).PrepareContext: the statement belongs to
// the transaction and is closed when it ends.
func (h *HandlerTx) PrepareContext(ctx context.Context, query string) (*sql.Stmt, error) {
	return h.tx.PrepareContext(ctx, query)
}

// Prepare is (*sql.Tx).Prepare.
func (h *HandlerTx) Prepare(query string) (*sql.Stmt, error) {
	return h.tx.Prepare(query)
}

// StmtContext is (*sql.Tx).StmtContext: stmt, prepared on the database,
// as a statement of the transaction.
func (h *HandlerTx) StmtContext(ctx context.Context, stmt *sql.Stmt) *sql.Stmt {
	return h.tx.StmtContext(ctx, stmt)
}

// Stmt is (*sql.Tx).Stmt.
func (h *HandlerTx) Stmt(stmt *sql.Stmt) *sql.Stmt {
	return h.tx.Stmt(stmt)
}
