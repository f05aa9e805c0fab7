package orders

import (
	"context"
	"database/sql"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"time"

	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/idem-go/idem/outbox/sqliteoutbox"
	"github.com/idem-go/idem/sqlitestore"
)

//go:embed migrations/sqlite/*.sql
var sqliteMigrations embed.FS

// SQLiteMigrations holds the SQLite schema of the orders, deployment and
// receipts tables as numbered .sql files (0001_create_orders.sql, …), to be
// applied in name order. MigrateSQLite applies them, after the outbox's.
var SQLiteMigrations fs.FS = mustSub(sqliteMigrations, "migrations/sqlite")

func mustSub(f fs.FS, dir string) fs.FS {
	sub, err := fs.Sub(f, dir)
	if err != nil {
		panic(err)
	}
	return sub
}

var _ Repository = (*SQLiteRepository)(nil)

// SQLiteRepository is a Repository on SQLite (modernc.org/sqlite). It
// writes each order's orders.created event (EventFor) to the outbox table
// of package outbox in the same database; MigrateSQLite creates both.
type SQLiteRepository struct {
	db     *sql.DB
	txFrom func(context.Context) (sqliteExecer, error) // nil: none
	outbox *sqliteoutbox.Table
}

// NewSQLiteRepository returns a repository on db. txFrom returns the
// transaction of the idempotent request that ctx belongs to (such as
// sqlitestore.FromContext); when it returns an error matching idem.ErrNoTx,
// or is nil, Create writes in a transaction of its own.
func NewSQLiteRepository(db *sql.DB, txFrom func(ctx context.Context) (*sqlitestore.HandlerTx, error)) *SQLiteRepository {
	r := &SQLiteRepository{db: db, outbox: sqliteoutbox.New(db)}
	if txFrom != nil {
		r.txFrom = func(ctx context.Context) (sqliteExecer, error) {
			tx, err := txFrom(ctx)
			if err != nil {
				return nil, err // not a nil *HandlerTx in an interface
			}
			return tx, nil
		}
	}
	return r
}

// timeLayout keeps nine fractional digits so that UTC times sort as text.
const timeLayout = "2006-01-02T15:04:05.000000000Z07:00"

func formatTime(t time.Time) string { return t.UTC().Format(timeLayout) }

// Create implements Repository: it inserts o and adds its orders.created
// event (EventFor) to the outbox, both in a savepoint of the request's
// transaction when there is one, else in a transaction of their own.
func (r *SQLiteRepository) Create(ctx context.Context, o *Order) error {
	rtx, err := r.requestTx(ctx)
	if err != nil {
		return err
	}
	if rtx != nil {
		return r.insertInSavepoint(ctx, rtx, o)
	}
	// Take this process's turn among the database's writers (the store's
	// and the outbox relay's) before SQLite's lock.
	unlock, err := sqlitestore.LockWrites(ctx, r.db)
	if err != nil {
		return fmt.Errorf("orders: begin: %w", err)
	}
	defer unlock()
	tx, err := r.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("orders: begin: %w", err)
	}
	defer tx.Rollback()
	if err := r.insert(ctx, tx, o); err != nil {
		return err
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("orders: commit: %w", err)
	}
	return nil
}

// insertInSavepoint inserts o and its event in a savepoint of tx, so that
// a refused insert leaves tx as it was and the request's transaction can
// still commit the answer that says the order could not be written.
func (r *SQLiteRepository) insertInSavepoint(ctx context.Context, tx sqliteExecer, o *Order) error {
	if _, err := tx.ExecContext(ctx, `SAVEPOINT orders_create`); err != nil {
		return fmt.Errorf("orders: savepoint: %w", err)
	}
	if err := r.insert(ctx, tx, o); err != nil {
		if _, rerr := tx.ExecContext(ctx, `ROLLBACK TO orders_create`); rerr != nil {
			return fmt.Errorf("orders: rolling back to the savepoint: %w (after: %v)", rerr, err)
		}
		if _, rerr := tx.ExecContext(ctx, `RELEASE orders_create`); rerr != nil {
			return fmt.Errorf("orders: releasing the savepoint: %w (after: %v)", rerr, err)
		}
		return err
	}
	if _, err := tx.ExecContext(ctx, `RELEASE orders_create`); err != nil {
		return fmt.Errorf("orders: releasing the savepoint: %w", err)
	}
	return nil
}

// sqliteExecer is the transaction an order or a receipt is written in: a
// *sql.Tx of its own, or the request's (*sqlitestore.HandlerTx), which it
// must not commit or roll back.
type sqliteExecer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// insert inserts o, then adds its event, in tx.
func (r *SQLiteRepository) insert(ctx context.Context, tx sqliteExecer, o *Order) error {
	if err := insertOrder(ctx, tx, o); err != nil {
		return err
	}
	// SQLite keeps the nanoseconds of CreatedAt (formatTime): o reads
	// back as it is.
	ev, err := EventFor(o)
	if err != nil {
		return err
	}
	if err := r.outbox.Add(ctx, tx, ev); err != nil {
		return eventError(o, err)
	}
	o.EventAdded = true
	return nil
}

func insertOrder(ctx context.Context, tx sqliteExecer, o *Order) error {
	items, err := json.Marshal(o.Items)
	if err != nil {
		return fmt.Errorf("orders: encoding items: %w", err)
	}
	var key, keyCreated sql.NullString
	if o.IdempotencyKey != "" {
		key = sql.NullString{String: o.IdempotencyKey, Valid: true}
		keyCreated = sql.NullString{String: formatTime(o.KeyCreatedAt), Valid: true}
	}
	_, err = tx.ExecContext(ctx, `INSERT INTO orders
		(id, user_id, status, items, total, currency, payment_id, idempotency_key, idempotency_key_created_at, created_at, event_added)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1)`,
		o.ID, o.UserID, o.Status, string(items), o.Total, o.Currency, o.PaymentID, key, keyCreated, formatTime(o.CreatedAt))
	if err != nil {
		return interpretWriteError(err)
	}
	return nil
}

// sqliteExistsIndexes are the column lists that SQLite names when a unique
// index whose violation means ErrExists refuses a row.
var sqliteExistsIndexes = map[string]bool{
	"orders.id": true,
	"orders.user_id, orders.idempotency_key, orders.idempotency_key_created_at": true,
}

// interpretWriteError is interpretError for the insert of an order: it
// returns ErrExists for the order's own unique keys and ErrUnwritable for
// the refusals that no retry changes: any other constraint (CHECK, NOT
// NULL, FOREIGN KEY, another UNIQUE, a trigger's RAISE(ABORT), a STRICT
// table's type), a value too big, a datatype mismatch. Busy, locked, I/O
// and full-disk errors are not: they may pass on a retry.
func interpretWriteError(err error) error {
	var se *sqlite.Error
	if !errors.As(err, &se) {
		return interpretError(err)
	}
	code := se.Code()
	switch {
	case code == sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY || code == sqlite3.SQLITE_CONSTRAINT_UNIQUE:
		if cols, ok := sqliteUniqueColumns(se.Error()); ok && !sqliteExistsIndexes[cols] {
			return fmt.Errorf("%w: %v", ErrUnwritable, err)
		}
		return fmt.Errorf("%w: %v", ErrExists, err)
	case code&0xff == sqlite3.SQLITE_CONSTRAINT, code&0xff == sqlite3.SQLITE_TOOBIG, code&0xff == sqlite3.SQLITE_MISMATCH:
		return fmt.Errorf("%w: %v", ErrUnwritable, err)
	}
	return interpretError(err)
}

// sqliteUniqueColumns returns the column list of a message such as
// "UNIQUE constraint failed: orders.id (1555)".
func sqliteUniqueColumns(msg string) (string, bool) {
	_, cols, ok := strings.Cut(msg, " constraint failed: ")
	if !ok {
		return "", false
	}
	if i := strings.LastIndex(cols, " ("); i >= 0 {
		cols = cols[:i]
	}
	return strings.TrimSpace(cols), true
}

// interpretError translates the driver's errors into the package's.
func interpretError(err error) error {
	var se *sqlite.Error
	if errors.As(err, &se) {
		switch se.Code() {
		case sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY, sqlite3.SQLITE_CONSTRAINT_UNIQUE:
			return fmt.Errorf("%w: %v", ErrExists, err)
		}
	}
	if errors.Is(err, sql.ErrNoRows) {
		return ErrNotFound
	}
	return fmt.Errorf("orders: %w", err)
}

const orderColumns = `id, user_id, status, items, total, currency, payment_id, idempotency_key, idempotency_key_created_at, created_at, event_added`

type scanner interface{ Scan(dest ...any) error }

func scanOrder(row scanner) (Order, error) {
	var (
		o                   Order
		items, created      string
		key, keyCreatedText sql.NullString
		eventAdded          sql.NullBool
	)
	if err := row.Scan(&o.ID, &o.UserID, &o.Status, &items, &o.Total, &o.Currency, &o.PaymentID, &key, &keyCreatedText, &created, &eventAdded); err != nil {
		return o, interpretError(err)
	}
	if err := json.Unmarshal([]byte(items), &o.Items); err != nil {
		return o, fmt.Errorf("orders: order %s: items: %w", o.ID, err)
	}
	var err error
	if o.CreatedAt, err = time.Parse(time.RFC3339Nano, created); err != nil {
		return o, fmt.Errorf("orders: order %s: created_at: %w", o.ID, err)
	}
	o.IdempotencyKey = key.String
	o.EventAdded = eventAdded.Valid && eventAdded.Bool
	if keyCreatedText.Valid {
		if o.KeyCreatedAt, err = time.Parse(time.RFC3339Nano, keyCreatedText.String); err != nil {
			return o, fmt.Errorf("orders: order %s: idempotency_key_created_at: %w", o.ID, err)
		}
	}
	return o, nil
}

// Get implements Repository.
func (r *SQLiteRepository) Get(ctx context.Context, userID, id string) (*Order, error) {
	o, err := scanOrder(r.db.QueryRowContext(ctx,
		`SELECT `+orderColumns+` FROM orders WHERE id = ? AND user_id = ?`, id, userID))
	if err != nil {
		return nil, err
	}
	return &o, nil
}

// List implements Repository. Pages are keyset-paginated on (created_at,
// id), newest first, so they stay stable while orders are added.
func (r *SQLiteRepository) List(ctx context.Context, userID string, limit int, startingAfter string) ([]Order, bool, error) {
	if limit < 1 {
		return nil, false, fmt.Errorf("orders: limit %d < 1", limit)
	}
	query := `SELECT ` + orderColumns + ` FROM orders WHERE user_id = ?`
	args := []any{userID}
	if startingAfter != "" {
		var created string
		err := r.db.QueryRowContext(ctx, `SELECT created_at FROM orders WHERE id = ? AND user_id = ?`, startingAfter, userID).Scan(&created)
		if err != nil {
			return nil, false, interpretError(err)
		}
		query += ` AND (created_at < ? OR (created_at = ? AND id < ?))`
		args = append(args, created, created, startingAfter)
	}
	query += ` ORDER BY created_at DESC, id DESC LIMIT ?`
	args = append(args, limit+1)
	rows, err := r.db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, false, interpretError(err)
	}
	defer rows.Close()
	var out []Order
	for rows.Next() {
		o, err := scanOrder(rows)
		if err != nil {
			return nil, false, err
		}
		out = append(out, o)
	}
	if err := rows.Err(); err != nil {
		return nil, false, interpretError(err)
	}
	more := len(out) > limit
	if more {
		out = out[:limit]
	}
	return out, more, nil
}

// Ping implements Repository: it also checks that the orders table exists.
func (r *SQLiteRepository) Ping(ctx context.Context) error {
	var one int
	err := r.db.QueryRowContext(ctx, `SELECT 1 FROM orders LIMIT 1`).Scan(&one)
	if err != nil && !errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("orders: ping: %w", err)
	}
	return nil
}
