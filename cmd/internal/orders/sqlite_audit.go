package orders

import "context"

// auditPageSize is how many orders AllOrders reads at a time.
const auditPageSize = 500

// AllOrders calls fn with every order of every user, IdempotencyKey and
// KeyCreatedAt included, ordered by user_id, created_at and id, for audits.
// It reads in keyset pages of a bounded size and holds no connection while
// fn runs, so fn may use the database; orders created during the scan
// appear when they sort after the current position. It stops at fn's
// first error and returns it as is.
func (r *SQLiteRepository) AllOrders(ctx context.Context, fn func(Order) error) error {
	page, err := r.query(ctx, `SELECT `+orderColumns+` FROM orders
		ORDER BY user_id, created_at, id LIMIT ?`, auditPageSize)
	for {
		if err != nil {
			return err
		}
		for _, o := range page {
			if err := fn(o); err != nil {
				return err
			}
		}
		if len(page) < auditPageSize {
			return nil
		}
		last := page[len(page)-1]
		page, err = r.query(ctx, `SELECT `+orderColumns+` FROM orders
			WHERE (user_id, created_at, id) > (?, ?, ?)
			ORDER BY user_id, created_at, id LIMIT ?`,
			last.UserID, formatTime(last.CreatedAt), last.ID, auditPageSize)
	}
}

// query returns every order that query selects.
func (r *SQLiteRepository) query(ctx context.Context, query string, args ...any) ([]Order, error) {
	rows, err := r.db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, interpretError(err)
	}
	defer rows.Close()
	var out []Order
	for rows.Next() {
		o, err := scanOrder(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, o)
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError(err)
	}
	return out, nil
}
