package orders

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem"
)

// requestTx returns the transaction of the idempotent request or operation
// that ctx belongs to, or nil when there is none.
func (r *PostgresRepository) requestTx(ctx context.Context) (pgx.Tx, error) {
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

// AddReceipt implements ReceiptWriter. On a conflict it waits for the
// transaction that wrote the event's receipt, as ON CONFLICT does, and
// reads what it committed: under READ COMMITTED, the default, each
// statement sees it.
func (r *PostgresRepository) AddReceipt(ctx context.Context, rc Receipt) (Receipt, bool, error) {
	rc, err := rc.withDefaults()
	if err != nil {
		return Receipt{}, false, err
	}
	tx, err := r.requestTx(ctx)
	if err != nil {
		return Receipt{}, false, err
	}
	var db pgQueryer = r.pool
	if tx != nil {
		db = tx
	}
	tag, err := db.Exec(ctx, `INSERT INTO receipts (id, order_id, event_id, user_id, total, currency, created_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (event_id, user_id) DO NOTHING`,
		rc.ID, rc.OrderID, rc.EventID, rc.UserID, rc.Total, rc.Currency, rc.CreatedAt)
	if err != nil {
		return Receipt{}, false, fmt.Errorf("orders: adding the receipt of %s: %w", rc.OrderID, err)
	}
	if tag.RowsAffected() == 1 {
		return rc, true, nil
	}
	var found Receipt
	err = db.QueryRow(ctx, `SELECT `+receiptColumns+` FROM receipts WHERE event_id = $1 AND user_id = $2`, rc.EventID, rc.UserID).
		Scan(&found.ID, &found.OrderID, &found.EventID, &found.UserID, &found.Total, &found.Currency, &found.CreatedAt)
	if err != nil {
		return Receipt{}, false, fmt.Errorf("orders: reading the receipt of event %s: %w", rc.EventID, err)
	}
	found.CreatedAt = found.CreatedAt.UTC()
	return rc.checkFound(found)
}

// pgQueryer is a pool or transaction that AddReceipt can both write and
// read through.
type pgQueryer interface {
	pgExecer
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// AllReceipts calls fn with every receipt, ordered by order_id and id, for
// audits. Like AllOrders it reads in keyset pages and holds no connection
// while fn runs, and it stops at fn's first error and returns it as is.
// The pages include user_id: the primary key, (id, user_id), does not
// keep two users from one receipt id, and both must be read.
func (r *PostgresRepository) AllReceipts(ctx context.Context, fn func(Receipt) error) error {
	page, err := r.queryReceipts(ctx, `SELECT `+receiptColumns+` FROM receipts
		ORDER BY order_id, id, user_id LIMIT $1`, auditPageSize)
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
			WHERE (order_id, id, user_id) > ($1, $2, $3) ORDER BY order_id, id, user_id LIMIT $4`,
			last.OrderID, last.ID, last.UserID, auditPageSize)
	}
}

func (r *PostgresRepository) queryReceipts(ctx context.Context, query string, args ...any) ([]Receipt, error) {
	rows, err := r.pool.Query(ctx, query, args...)
	if err != nil {
		return nil, fmt.Errorf("orders: reading receipts: %w", err)
	}
	defer rows.Close()
	var out []Receipt
	for rows.Next() {
		var rc Receipt
		if err := rows.Scan(&rc.ID, &rc.OrderID, &rc.EventID, &rc.UserID, &rc.Total, &rc.Currency, &rc.CreatedAt); err != nil {
			return nil, fmt.Errorf("orders: reading receipts: %w", err)
		}
		// pgx returns times in time.Local.
		rc.CreatedAt = rc.CreatedAt.UTC()
		out = append(out, rc)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("orders: reading receipts: %w", err)
	}
	return out, nil
}
