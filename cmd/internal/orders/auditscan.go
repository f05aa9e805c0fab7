package orders

import (
	"context"
	"time"
)

// scanPageSize is how many rows one page of OrdersByID or ReceiptsSince
// reads.
const scanPageSize = 2000

// OrdersByID calls fn with every order whose operation began at or after
// since (its key's KeyCreatedAt, or its CreatedAt without a key; every
// order when since is zero), IdempotencyKey and KeyCreatedAt included,
// ordered by id (bytewise), for audits. It reads in keyset pages of a
// bounded size and holds no connection while fn runs. It stops at fn's
// first error and returns it as is.
//
// The pages follow the primary key, (id, user_id): the key does not keep
// two users from one id, and the audit must see both orders of such an id
// to report it, wherever a page ends.
func (r *PostgresRepository) OrdersByID(ctx context.Context, since time.Time, fn func(Order) error) error {
	after, afterUser := "", ""
	for {
		page, err := r.query(ctx, `SELECT `+orderColumns+` FROM orders
			WHERE (id, user_id) > ($1, $2) AND coalesce(idempotency_key_created_at, created_at) >= $3
			ORDER BY id, user_id LIMIT $4`, after, afterUser, since, scanPageSize)
		if err != nil {
			return err
		}
		for _, o := range page {
			if err := fn(o); err != nil {
				return err
			}
		}
		if len(page) < scanPageSize {
			return nil
		}
		after, afterUser = page[len(page)-1].ID, page[len(page)-1].UserID
	}
}

// OrderExists reports whether the order id exists.
func (r *PostgresRepository) OrderExists(ctx context.Context, id string) (bool, error) {
	var found bool
	if err := r.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM orders WHERE id = $1)`, id).Scan(&found); err != nil {
		return false, interpretPgError(err)
	}
	return found, nil
}

// ReceiptsSince calls fn with every receipt created at or after since
// (every receipt when since is zero), ordered by order_id and id, for
// audits; in keyset pages, as AllReceipts (whose pages include user_id).
func (r *PostgresRepository) ReceiptsSince(ctx context.Context, since time.Time, fn func(Receipt) error) error {
	var afterOrder, afterID, afterUser string
	for {
		page, err := r.queryReceipts(ctx, `SELECT `+receiptColumns+` FROM receipts
			WHERE (order_id, id, user_id) > ($1, $2, $3) AND created_at >= $4
			ORDER BY order_id, id, user_id LIMIT $5`, afterOrder, afterID, afterUser, since, scanPageSize)
		if err != nil {
			return err
		}
		for _, rc := range page {
			if err := fn(rc); err != nil {
				return err
			}
		}
		if len(page) < scanPageSize {
			return nil
		}
		last := page[len(page)-1]
		afterOrder, afterID, afterUser = last.OrderID, last.ID, last.UserID
	}
}

// OrdersByID is PostgresRepository.OrdersByID on SQLite.
func (r *SQLiteRepository) OrdersByID(ctx context.Context, since time.Time, fn func(Order) error) error {
	after := ""
	for {
		page, err := r.query(ctx, `SELECT `+orderColumns+` FROM orders
			WHERE id > ? AND coalesce(idempotency_key_created_at, created_at) >= ?
			ORDER BY id LIMIT ?`, after, formatTime(since), scanPageSize)
		if err != nil {
			return err
		}
		for _, o := range page {
			if err := fn(o); err != nil {
				return err
			}
		}
		if len(page) < scanPageSize {
			return nil
		}
		after = page[len(page)-1].ID
	}
}

// OrderExists reports whether the order id exists.
func (r *SQLiteRepository) OrderExists(ctx context.Context, id string) (bool, error) {
	var found bool
	if err := r.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM orders WHERE id = ?)`, id).Scan(&found); err != nil {
		return false, interpretError(err)
	}
	return found, nil
}

// ReceiptsSince is PostgresRepository.ReceiptsSince on SQLite.
func (r *SQLiteRepository) ReceiptsSince(ctx context.Context, since time.Time, fn func(Receipt) error) error {
	var afterOrder, afterID string
	for {
		page, err := r.queryReceipts(ctx, `SELECT `+receiptColumns+` FROM receipts
			WHERE (order_id, id) > (?, ?) AND created_at >= ?
			ORDER BY order_id, id LIMIT ?`, afterOrder, afterID, formatTime(since), scanPageSize)
		if err != nil {
			return err
		}
		for _, rc := range page {
			if err := fn(rc); err != nil {
				return err
			}
		}
		if len(page) < scanPageSize {
			return nil
		}
		last := page[len(page)-1]
		afterOrder, afterID = last.OrderID, last.ID
	}
}
