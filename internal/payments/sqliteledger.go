package payments

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/sqlitestore"
)

var _ Ledger = (*SQLiteLedger)(nil)

// SQLiteLedger is a Ledger in the SQLite table payment_intents (see
// MigrateSQLite), for a gateway whose idempotency store is a
// sqlitestore.Store on the same database file: inside an idempotent
// request it writes through the store's transaction
// (sqlitestore.FromContext), so a PaymentIntent commits together with the
// stored response, fenced on the request's lease, or not at all. It is
// safe for concurrent use.
type SQLiteLedger struct {
	db *sql.DB

	mu   sync.Mutex // guards last
	last int64      // the last created_at written, Unix nanoseconds
}

// NewSQLiteLedger returns the ledger in db's payment_intents table. db
// should be the idempotency store's (sqlitestore.Store.DB), whose
// connections wait for the write lock; the table must exist: call
// MigrateSQLite (or OpenSQLite) first.
func NewSQLiteLedger(db *sql.DB) *SQLiteLedger { return &SQLiteLedger{db: db} }

// MigrateSQLite creates or upgrades the ledger's table in db, recording its
// migrations under Component. It is safe to call from several processes at
// once (sqlitestore.ApplyMigrations).
func MigrateSQLite(ctx context.Context, db *sql.DB) error {
	return sqlitestore.ApplyMigrations(ctx, db, Component, migrationsFor("sqlite"))
}

const sqliteInsertPI = `INSERT INTO payment_intents (` + piColumns + `, created_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`

// writtenAt returns the created_at of a new row: the time, made to go
// forward within this ledger so that rows written one after the other
// list in that order.
func (l *SQLiteLedger) writtenAt() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.last = max(time.Now().UnixNano(), l.last+1)
	return l.last
}

// Create implements Ledger. Inside an idempotent request the row is
// written in the request's sqlitestore transaction, and commits with its
// outcome; a request of another store's is ErrForeignTx. Without one it is
// written at once. Like a real gateway the write does not heed the
// cancellation of ctx.
func (l *SQLiteLedger) Create(ctx context.Context, pi *PaymentIntent) error {
	args, err := piValues(pi)
	if err != nil {
		return err
	}
	args = append(args, l.writtenAt())
	var db interface {
		ExecContext(context.Context, string, ...any) (sql.Result, error)
	}
	itx, err := idem.TxFromContext(ctx)
	switch {
	case errors.Is(err, idem.ErrNoTx):
		db = l.db
	case err != nil:
		return fmt.Errorf("payments: joining the idempotent transaction: %w", err)
	default:
		if _, ok := idem.UnwrapTx(itx).(*sqlitestore.Tx); !ok {
			return fmt.Errorf("%w: the SQLite ledger needs a sqlitestore transaction, not %T", ErrForeignTx, itx)
		}
		tx, err := sqlitestore.FromContext(ctx)
		if err != nil {
			return fmt.Errorf("payments: joining the idempotent transaction: %w", err)
		}
		db = tx
	}
	if _, err := db.ExecContext(context.WithoutCancel(ctx), sqliteInsertPI, args...); err != nil {
		return fmt.Errorf("payments: recording %s: %w", pi.ID, err)
	}
	return nil
}

// Get implements Ledger.
func (l *SQLiteLedger) Get(ctx context.Context, account, id string) (*PaymentIntent, error) {
	pi, err := scanPI(l.db.QueryRowContext(ctx, `SELECT `+piColumns+` FROM payment_intents WHERE id = ? AND account = ?`, id, account))
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil, fmt.Errorf("%w: %s", ErrNotFound, id)
	case err != nil:
		return nil, fmt.Errorf("payments: get %s: %w", id, err)
	}
	return pi, nil
}

// List implements Ledger: newest first by the time each row was written,
// the id breaking ties, by key set.
func (l *SQLiteLedger) List(ctx context.Context, q ListQuery) (Page, error) {
	limit := q.limit()
	var (
		rows *sql.Rows
		at   int64
		err  error
	)
	switch {
	case q.EndingBefore != "":
		if at, err = l.cursor(ctx, q.Account, q.EndingBefore); err != nil {
			return Page{}, err
		}
		rows, err = l.db.QueryContext(ctx, `SELECT `+piColumns+` FROM payment_intents
			WHERE account = ? AND (created_at, id) > (?, ?)
			ORDER BY created_at, id LIMIT ?`, q.Account, at, q.EndingBefore, limit+1)
	case q.StartingAfter != "":
		if at, err = l.cursor(ctx, q.Account, q.StartingAfter); err != nil {
			return Page{}, err
		}
		rows, err = l.db.QueryContext(ctx, `SELECT `+piColumns+` FROM payment_intents
			WHERE account = ? AND (created_at, id) < (?, ?)
			ORDER BY created_at DESC, id DESC LIMIT ?`, q.Account, at, q.StartingAfter, limit+1)
	default:
		rows, err = l.db.QueryContext(ctx, `SELECT `+piColumns+` FROM payment_intents
			WHERE account = ?
			ORDER BY created_at DESC, id DESC LIMIT ?`, q.Account, limit+1)
	}
	if err != nil {
		return Page{}, fmt.Errorf("payments: list: %w", err)
	}
	defer rows.Close()
	var pis []*PaymentIntent
	for rows.Next() {
		pi, err := scanPI(rows)
		if err != nil {
			return Page{}, fmt.Errorf("payments: list: %w", err)
		}
		pis = append(pis, pi)
	}
	if err := rows.Err(); err != nil {
		return Page{}, fmt.Errorf("payments: list: %w", err)
	}
	return page(pis, limit, q.EndingBefore != ""), nil
}

// cursor returns when the PaymentIntent id of account was written, or
// ErrNotFound.
func (l *SQLiteLedger) cursor(ctx context.Context, account, id string) (int64, error) {
	var at int64
	err := l.db.QueryRowContext(ctx, `SELECT created_at FROM payment_intents WHERE id = ? AND account = ?`, id, account).Scan(&at)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return 0, fmt.Errorf("%w: %s", ErrNotFound, id)
	case err != nil:
		return 0, fmt.Errorf("payments: list: %w", err)
	}
	return at, nil
}

// Count implements Counter.
func (l *SQLiteLedger) Count(ctx context.Context, account string) (int, error) {
	var n int
	err := l.db.QueryRowContext(ctx, `SELECT count(*) FROM payment_intents WHERE account = ? AND status = ?`, account, StatusSucceeded).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("payments: count: %w", err)
	}
	return n, nil
}
