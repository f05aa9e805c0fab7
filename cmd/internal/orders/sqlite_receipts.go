package orders

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/sqlitestore"
)

// requestTx returns the transaction of the idempotent request or operation
// that ctx belongs to, or nil when there is none.
func (r *SQLiteRepository) requestTx(ctx context.Context) (sqliteExecer, error) {
	if r.txFrom == nil {
		return nil, nil
	}
	tx, err := r.txFrom(ctx)
	switch {
	case err == nil:
		return tx, nil
	case errors.Is(err, idem.ErrNoTx):
		return nil, nil
	}
	return nil, fmt.Errorf("orders: request transaction: %w", err)
}

// AddReceipt implements ReceiptWriter.
func (r *SQLiteRepository) AddReceipt(ctx context.Context, rc Receipt) (Receipt, bool, error) {
	rc, err := rc.withDefaults()
	if err != nil {
		return Receipt{}, false, err
	}
	tx, err := r.requestTx(ctx)
	if err != nil {
		return Receipt{}, false, err
	}
	var db sqliteQueryer = r.db
	if tx != nil {
		q, ok := tx.(sqliteQueryer)
		if !ok {
			return Receipt{}, false, fmt.Errorf("orders: request transaction %T cannot query", tx)
		}
		db = q
	} else {
		// A statement of its own: it takes this process's turn among the
		// database's writers before SQLite's lock.
		unlock, err := sqlitestore.LockWrites(ctx, r.db)
		if err != nil {
			return Receipt{}, false, fmt.Errorf("orders: adding the receipt of %s: %w", rc.OrderID, err)
		}
		defer unlock()
	}
	res, err := db.ExecContext(ctx, `INSERT INTO receipts (id, order_id, event_id, user_id, total, currency, created_at)
		VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (event_id, user_id) DO NOTHING`,
		rc.ID, rc.OrderID, rc.EventID, rc.UserID, rc.Total, rc.Currency, formatTime(rc.CreatedAt))
	if err != nil {
		return Receipt{}, false, fmt.Errorf("orders: adding the receipt of %s: %w", rc.OrderID, err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return Receipt{}, false, fmt.Errorf("orders: adding the receipt of %s: %w", rc.OrderID, err)
	} else if n == 1 {
		return rc, true, nil
	}
	// The event's receipt is there: in this transaction's view, as
	// SQLite's writers take turns.
	found, created := Receipt{}, ""
	err = db.QueryRowContext(ctx, `SELECT `+receiptColumns+` FROM receipts WHERE event_id = ? AND user_id = ?`, rc.EventID, rc.UserID).
		Scan(&found.ID, &found.OrderID, &found.EventID, &found.UserID, &found.Total, &found.Currency, &created)
	if err == nil {
		found.CreatedAt, err = time.Parse(time.RFC3339Nano, created)
	}
	if err != nil {
		return Receipt{}, false, fmt.Errorf("orders: reading the receipt of event %s: %w", rc.EventID, err)
	}
	return rc.checkFound(found)
}

// sqliteQueryer is a database or transaction that AddReceipt can both
// write and read through.
type sqliteQueryer interface {
	sqliteExecer
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// AllReceipts calls fn with every receipt, ordered by order_id and id, for
// audits. Like AllOrders it reads in keyset pages and holds no connection
// while fn runs, and it stops at fn's first error and returns it as is.
func (r *SQLiteRepository) AllReceipts(ctx context.Context, fn func(Receipt) error) error {
	page, err := r.queryReceipts(ctx, `SELECT `+receiptColumns+` FROM receipts
		ORDER BY order_id, id LIMIT ?`, auditPageSize)
	for {
		if err != nil {
			return err
		}
		for _, rc := range page {
			if err := fn(rc); err != nil {
				return err
			}
		}
		if len(page) < auditPageSize {
			return nil
		}
		last := page[len(page)-1]
		page, err = r.queryReceipts(ctx, `SELECT `+receiptColumns+` FROM receipts
			WHERE (order_id, id) > (?, ?) ORDER BY order_id, id LIMIT ?`,
			last.OrderID, last.ID, auditPageSize)
	}
}

const receiptColumns = `id, order_id, event_id, user_id, total, currency, created_at`

func (r *SQLiteRepository) queryReceipts(ctx context.Context, query string, args ...any) ([]Receipt, error) {
	rows, err := r.db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("orders: reading receipts: %w", err)
	}
	defer rows.Close()
	var out []Receipt
	for rows.Next() {
		var (
			rc      Receipt
			created string
		)
		if err := rows.Scan(&rc.ID, &rc.OrderID, &rc.EventID, &rc.UserID, &rc.Total, &rc.Currency, &created); err != nil {
			return nil, fmt.Errorf("orders: reading receipts: %w", err)
		}
		if rc.CreatedAt, err = time.Parse(time.RFC3339Nano, created); err != nil {
			return nil, fmt.Errorf("orders: receipt %s: created_at: %w", rc.ID, err)
		}
		out = append(out, rc)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("orders: reading receipts: %w", err)
	}
	return out, nil
}
