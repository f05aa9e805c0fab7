package payments

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"sync"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
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
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`

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
// written at once, in its turn among the database's writers of this
// process (sqlitestore.LockWrites): past that queue it would poll SQLite's
// write lock while the store's writers hand it to each other, and fail
// with SQLITE_BUSY under steady keyed traffic. Like a real gateway the
// write does not heed the cancellation of ctx.
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
		unlock, err := sqlitestore.LockWrites(context.WithoutCancel(ctx), l.db)
		if err != nil {
			return fmt.Errorf("payments: recording %s: %w", pi.ID, err)
		}
		defer unlock()
		db = l.db
	case err != nil:
		return fmt.Errorf("payments: joining the idempotent transaction: %w", err)
	default:
		if _, ok := idemdriver.UnwrapTx(itx).(*sqlitestore.Tx); !ok {
			return fmt.Errorf("%w: the SQLite ledger needs a sqlitestore transaction, not %T", ErrForeignTx, idemdriver.UnwrapTx(itx))
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
	pis, err := scanAll(rows, scanPI)
	if err != nil {
		return Page{}, fmt.Errorf("payments: list: %w", err)
	}
	return page(pis, limit, q.EndingBefore != ""), nil
}

// sqliteIndexedKey matches the metadata keys that Search may write into
// its SQL as a JSON path literal: with the literal, SQLite can use an
// index on the same expression (payment_intents_order_ref for order_ref).
var sqliteIndexedKey = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// Search implements Ledger: newest first by the time each row was
// written, the id breaking ties, by key set. A metadata key of letters,
// digits and underscores is matched with json_extract on a literal path,
// which the index payment_intents_order_ref serves for order_ref; any
// other key through json_each.
func (l *SQLiteLedger) Search(ctx context.Context, q SearchQuery) (Page, error) {
	var at int64
	if q.StartingAfter != "" {
		var err error
		if at, err = l.cursor(ctx, q.Account, q.StartingAfter); err != nil {
			return Page{}, err
		}
	}
	query, args := sqliteSearchSQL(q, q.StartingAfter != "", at)
	rows, err := l.db.QueryContext(ctx, query, args...)
	if err != nil {
		return Page{}, fmt.Errorf("payments: search: %w", err)
	}
	pis, err := scanAll(rows, scanPI)
	if err != nil {
		return Page{}, fmt.Errorf("payments: search: %w", err)
	}
	return page(pis, q.limit(), false), nil
}

// sqliteSearchSQL returns Search's statement and its arguments, the page
// after the row written at at (and its id, q.StartingAfter) when
// afterCursor.
func sqliteSearchSQL(q SearchQuery, afterCursor bool, at int64) (string, []any) {
	var (
		where string
		args  []any
	)
	if sqliteIndexedKey.MatchString(q.MetadataKey) {
		where = `account = ? AND json_extract(metadata, '$.` + q.MetadataKey + `') = ?`
		args = []any{q.Account, q.MetadataValue}
	} else {
		where = `account = ? AND EXISTS (SELECT 1 FROM json_each(payment_intents.metadata) AS m WHERE m.key = ? AND m.value = ?)`
		args = []any{q.Account, q.MetadataKey, q.MetadataValue}
	}
	where += ` AND (? = '' OR status = ?)`
	args = append(args, q.Status, q.Status)
	if afterCursor {
		where += ` AND (created_at, id) < (?, ?)`
		args = append(args, at, q.StartingAfter)
	}
	args = append(args, q.limit()+1)
	return `SELECT ` + piColumns + ` FROM payment_intents
		WHERE ` + where + `
		ORDER BY created_at DESC, id DESC LIMIT ?`, args
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

// CreateRefund implements Ledger: in the request's sqlitestore
// transaction (else in one of its own), which holds SQLite's write lock
// from its start, it checks the refund against the PaymentIntent, adds to
// its amount_refunded and writes the refund. Like a real gateway the write
// does not heed the cancellation of ctx.
func (l *SQLiteLedger) CreateRefund(ctx context.Context, r *RefundRecord) error {
	ctx2 := context.WithoutCancel(ctx)
	itx, err := idem.TxFromContext(ctx)
	switch {
	case errors.Is(err, idem.ErrNoTx):
		unlock, err := sqlitestore.LockWrites(ctx2, l.db) // this process's turn among the database's writers
		if err != nil {
			return fmt.Errorf("payments: refunding %s: %w", r.PaymentIntent, err)
		}
		defer unlock()
		tx, err := l.db.BeginTx(ctx2, nil)
		if err != nil {
			return fmt.Errorf("payments: refunding %s: %w", r.PaymentIntent, err)
		}
		defer tx.Rollback()
		if err := l.refund(ctx2, tx, r); err != nil {
			return err
		}
		if err := tx.Commit(); err != nil {
			return fmt.Errorf("payments: refunding %s: %w", r.PaymentIntent, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("payments: joining the idempotent transaction: %w", err)
	}
	if _, ok := idemdriver.UnwrapTx(itx).(*sqlitestore.Tx); !ok {
		return fmt.Errorf("%w: the SQLite ledger needs a sqlitestore transaction, not %T", ErrForeignTx, idemdriver.UnwrapTx(itx))
	}
	tx, err := sqlitestore.FromContext(ctx)
	if err != nil {
		return fmt.Errorf("payments: joining the idempotent transaction: %w", err)
	}
	return l.refund(ctx2, tx, r)
}

// sqliteTx is what a refund needs of its transaction: a *sql.Tx of its
// own, or the request's (sqlitestore.HandlerTx).
type sqliteTx interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

func (l *SQLiteLedger) refund(ctx context.Context, tx sqliteTx, r *RefundRecord) error {
	var (
		status, currency   string
		received, refunded int64
	)
	err := tx.QueryRowContext(ctx, `SELECT status, currency, amount_received, amount_refunded FROM payment_intents
		WHERE id = ? AND account = ?`, r.PaymentIntent, r.Account).Scan(&status, &currency, &received, &refunded)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return fmt.Errorf("%w: %s", ErrNotFound, r.PaymentIntent)
	case err != nil:
		return fmt.Errorf("payments: refunding %s: %w", r.PaymentIntent, err)
	}
	if err := refundAmount(r, status, received, refunded); err != nil {
		return err
	}
	r.Currency = currency
	args, err := refundValues(r)
	if err != nil {
		return err
	}
	// The guard in the WHERE clause keeps the check even if the
	// transaction did not hold the write lock.
	res, err := tx.ExecContext(ctx, `UPDATE payment_intents SET amount_refunded = amount_refunded + ?
		WHERE id = ? AND amount_refunded = ?`, r.Amount, r.PaymentIntent, refunded)
	if err != nil {
		return fmt.Errorf("payments: refunding %s: %w", r.PaymentIntent, err)
	}
	if n, err := res.RowsAffected(); err != nil || n != 1 {
		return fmt.Errorf("payments: refunding %s: the PaymentIntent changed during the refund (%d rows, %v)", r.PaymentIntent, n, err)
	}
	args = append(args, l.writtenAt())
	if _, err := tx.ExecContext(ctx, `INSERT INTO refunds (`+refundColumns+`, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`, args...); err != nil {
		return fmt.Errorf("payments: recording %s: %w", r.ID, err)
	}
	return nil
}

// ListRefunds implements Ledger: newest first by the time each row was
// written, the id breaking ties, by key set.
func (l *SQLiteLedger) ListRefunds(ctx context.Context, q RefundQuery) (RefundPage, error) {
	limit := q.limit()
	where := `account = ? AND (? = '' OR payment_intent = ?)`
	var (
		rows *sql.Rows
		at   int64
		err  error
	)
	switch {
	case q.EndingBefore != "":
		if at, err = l.refundCursor(ctx, q.Account, q.EndingBefore); err != nil {
			return RefundPage{}, err
		}
		rows, err = l.db.QueryContext(ctx, `SELECT `+refundColumns+` FROM refunds
			WHERE `+where+` AND (created_at, id) > (?, ?)
			ORDER BY created_at, id LIMIT ?`, q.Account, q.PaymentIntent, q.PaymentIntent, at, q.EndingBefore, limit+1)
	case q.StartingAfter != "":
		if at, err = l.refundCursor(ctx, q.Account, q.StartingAfter); err != nil {
			return RefundPage{}, err
		}
		rows, err = l.db.QueryContext(ctx, `SELECT `+refundColumns+` FROM refunds
			WHERE `+where+` AND (created_at, id) < (?, ?)
			ORDER BY created_at DESC, id DESC LIMIT ?`, q.Account, q.PaymentIntent, q.PaymentIntent, at, q.StartingAfter, limit+1)
	default:
		rows, err = l.db.QueryContext(ctx, `SELECT `+refundColumns+` FROM refunds
			WHERE `+where+`
			ORDER BY created_at DESC, id DESC LIMIT ?`, q.Account, q.PaymentIntent, q.PaymentIntent, limit+1)
	}
	if err != nil {
		return RefundPage{}, fmt.Errorf("payments: list refunds: %w", err)
	}
	rs, err := scanAll(rows, scanRefund)
	if err != nil {
		return RefundPage{}, fmt.Errorf("payments: list refunds: %w", err)
	}
	return refundPage(rs, limit, q.EndingBefore != ""), nil
}

// refundCursor returns when the refund id of account was written, or
// ErrNotFound.
func (l *SQLiteLedger) refundCursor(ctx context.Context, account, id string) (int64, error) {
	var at int64
	err := l.db.QueryRowContext(ctx, `SELECT created_at FROM refunds WHERE id = ? AND account = ?`, id, account).Scan(&at)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return 0, fmt.Errorf("%w: %s", ErrNotFound, id)
	case err != nil:
		return 0, fmt.Errorf("payments: list refunds: %w", err)
	}
	return at, nil
}

// scanAll reads every row with scan and closes rows.
func scanAll[T any](rows *sql.Rows, scan func(interface{ Scan(...any) error }) (T, error)) ([]T, error) {
	defer rows.Close()
	var out []T
	for rows.Next() {
		v, err := scan(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, rows.Err()
}
