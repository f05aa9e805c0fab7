package orders

import (
	"context"
	"database/sql"
	"fmt"
)

// eventIDSQL is EventID in SQL, of the order id column o.id.
const eventIDSQL = `CASE WHEN substr(o.id, 1, 4) = 'ord_' THEN 'evt_' || substr(o.id, 5) ELSE 'evt-' || o.id END`

// withoutEventSQL selects, oldest first, orders that have no
// orders.created event in the outbox: orders written before the service
// wrote events. Its limit is its only parameter.
const withoutEventSQL = `SELECT ` + orderColumns + ` FROM orders o
	WHERE NOT EXISTS (SELECT 1 FROM idem_outbox e WHERE e.id = ` + eventIDSQL + `)
	ORDER BY o.created_at, o.id LIMIT `

// BackfillEvents adds the orders.created event (EventFor) of up to limit
// orders that have none, oldest first, in one transaction, and returns how
// many it added: call it until it returns 0. Such orders were written
// before the service wrote events (an upgraded database); the relay then
// publishes their events, after those already waiting for the same user.
// Several processes may run it at once: SQLite runs one write transaction
// at a time, and the second sees the first's events.
func (r *SQLiteRepository) BackfillEvents(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	tx, err := r.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("orders: backfilling events: begin: %w", interpretError(err))
	}
	defer tx.Rollback()
	// A write first, which matches no row: the transaction takes the write
	// lock (waiting under busy_timeout) before it reads, whatever the
	// pool's _txlock, so its read cannot go stale before its writes.
	if _, err := tx.ExecContext(ctx, `UPDATE idem_outbox SET attempts = attempts WHERE 0`); err != nil {
		return 0, fmt.Errorf("orders: backfilling events: %w", interpretError(err))
	}
	batch, err := sqliteWithoutEvent(ctx, tx, limit)
	if err != nil {
		return 0, fmt.Errorf("orders: backfilling events: %w", err)
	}
	for i := range batch {
		ev, err := EventFor(&batch[i])
		if err != nil {
			return 0, err
		}
		if err := r.outbox.Add(ctx, tx, ev); err != nil {
			return 0, fmt.Errorf("orders: backfilling the event of order %s: %w", batch[i].ID, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("orders: backfilling events: commit: %w", interpretError(err))
	}
	return len(batch), nil
}

// sqliteWithoutEvent reads up to limit orders without their event in tx.
func sqliteWithoutEvent(ctx context.Context, tx *sql.Tx, limit int) ([]Order, error) {
	rows, err := tx.QueryContext(ctx, withoutEventSQL+`?`, limit)
	if err != nil {
		return nil, interpretError(err)
	}
	defer rows.Close()
	var batch []Order
	for rows.Next() {
		o, err := scanOrder(rows)
		if err != nil {
			return nil, err
		}
		batch = append(batch, o)
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError(err)
	}
	return batch, nil
}

// BackfillEvents is SQLiteRepository.BackfillEvents on PostgreSQL: a
// transaction-scoped advisory lock makes concurrent callers take turns,
// and each reads the orders after the previous one committed.
func (r *PostgresRepository) BackfillEvents(ctx context.Context, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("orders: backfilling events: begin: %w", interpretPgError(err))
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('orders.backfill_events'))`); err != nil {
		return 0, fmt.Errorf("orders: backfilling events: %w", interpretPgError(err))
	}
	rows, err := tx.Query(ctx, withoutEventSQL+`$1`, limit)
	if err != nil {
		return 0, fmt.Errorf("orders: backfilling events: %w", interpretPgError(err))
	}
	var batch []Order
	for rows.Next() {
		o, err := scanPgOrder(rows)
		if err != nil {
			rows.Close()
			return 0, fmt.Errorf("orders: backfilling events: %w", err)
		}
		batch = append(batch, o)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("orders: backfilling events: %w", interpretPgError(err))
	}
	for i := range batch {
		ev, err := EventFor(&batch[i])
		if err != nil {
			return 0, err
		}
		if err := r.outbox.Add(ctx, tx, ev); err != nil {
			return 0, fmt.Errorf("orders: backfilling the event of order %s: %w", batch[i].ID, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("orders: backfilling events: commit: %w", interpretPgError(err))
	}
	return len(batch), nil
}
