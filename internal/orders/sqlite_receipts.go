package orders

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idem-go/idem"
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
func (r *SQLiteRepository) AddReceipt(ctx context.Context, rc Receipt) error {
	rc, err := rc.withDefaults()
	if err != nil {
		return err
	}
	tx, err := r.requestTx(ctx)
	if err != nil {
		return err
	}
	const insert = `INSERT INTO receipts (id, order_id, event_id, user_id, total, currency, created_at)
		VALUES (?, ?, ?, ?, ?, ?, ?)`
	args := []any{rc.ID, rc.OrderID, rc.EventID, rc.UserID, rc.Total, rc.Currency, formatTime(rc.CreatedAt)}
	if tx != nil {
		_, err = tx.ExecContext(ctx, insert, args...)
	} else {
		_, err = r.db.ExecContext(ctx, insert, args...)
	}
	if err != nil {
		return fmt.Errorf("orders: adding the receipt of %s: %w", rc.OrderID, err)
	}
	return nil
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
