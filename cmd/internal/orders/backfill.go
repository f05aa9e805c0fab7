package orders

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/sqlitestore"
)

// The pages of BackfillEvents: the keys of the orders not marked
// event_added, in the order of the partial index orders_event_not_added
// (user_id, created_at, id), from the first or after a key. Each reads one
// range of the index, whatever the rest of the table holds.
const (
	sqliteFirstKeys = `SELECT user_id, created_at, id FROM orders WHERE event_added IS NULL
		ORDER BY user_id, created_at, id LIMIT ?`
	sqliteNextKeys = `SELECT user_id, created_at, id FROM orders
		WHERE event_added IS NULL AND (user_id, created_at, id) > (?, ?, ?)
		ORDER BY user_id, created_at, id LIMIT ?`
	pgFirstKeys = `SELECT user_id, created_at, id FROM orders WHERE event_added IS NULL
		ORDER BY user_id, created_at, id LIMIT $1`
	pgNextKeys = `SELECT user_id, created_at, id FROM orders
		WHERE event_added IS NULL AND (user_id, created_at, id) > ($1, $2, $3)
		ORDER BY user_id, created_at, id LIMIT $4`
)

// orderKey is an order's place in the index orders_user_id_created_at_id.
// created is the column as the driver reads it: text on SQLite, a
// timestamptz on PostgreSQL.
type orderKey[T any] struct {
	user    string
	created T
	id      string
}

// eventIDs returns the event ids (EventID) of the orders ids.
func eventIDs(ids []string) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = EventID(id)
	}
	return out
}

// without returns the order ids of ids whose event id is not in have.
func without(ids []string, have map[string]bool) []string {
	var out []string
	for _, id := range ids {
		if !have[EventID(id)] {
			out = append(out, id)
		}
	}
	return out
}

// BackfillEvents gives every order that has no orders.created event
// (EventFor) its event, and returns how many it added. Such orders were
// written before the service wrote events (an upgraded database), or by
// an older binary during an upgrade; the relay then publishes their
// events, after those already waiting for the same user, and one user's
// in the order they were created.
//
// It reads only the orders not marked event_added (every order this
// version writes is marked with its event), batch at a time, by user,
// creation and id (a range of the partial index orders_event_not_added),
// and looks their event ids up in the outbox (its primary key), without a
// lock. Each batch's missing events it adds in one transaction that holds
// the write lock, looks them up again and reads their orders, and marks
// the whole batch, so that several processes may run it at once, and the
// next run reads none of them again: an event the outbox deleted after it
// was sent (outbox.Sweeper) is never added a second time. Its cost grows
// with the number of unmarked orders, once. progress, when not nil, is
// called after each batch with the total added so far.
func (r *SQLiteRepository) BackfillEvents(ctx context.Context, batch int, progress func(added int)) (int, error) {
	without := func(ctx context.Context, ids []string) ([]string, error) { return sqliteWithoutEvent(ctx, r.db, ids) }
	return backfill(ctx, batch, progress, r.keys, without, r.addMissingEvents)
}

// backfill is BackfillEvents' walk, on a database's keys (a page of up to
// limit orders' keys after last, nil: from the first), without (the ids
// of ids whose event is not in the outbox, read without a lock) and add
// (addMissingEvents: it adds the events of missing that are still
// missing and marks every order of batch).
func backfill[T any](ctx context.Context, batch int, progress func(added int),
	keys func(ctx context.Context, last *orderKey[T], limit int) ([]orderKey[T], error),
	without func(ctx context.Context, ids []string) ([]string, error),
	add func(ctx context.Context, missing, batch []string) (int, error),
) (int, error) {
	batch = max(batch, 1)
	total := 0
	var last *orderKey[T]
	for {
		page, err := keys(ctx, last, batch)
		if err != nil {
			return total, err
		}
		ids := make([]string, len(page))
		for i, k := range page {
			ids[i] = k.id
		}
		missing, err := without(ctx, ids)
		if err != nil {
			return total, err
		}
		// Even a batch without a missing event is marked.
		n, err := add(ctx, missing, ids)
		total += n
		if err != nil {
			return total, err
		}
		if progress != nil {
			progress(total)
		}
		if len(page) < batch {
			return total, nil
		}
		last = &page[len(page)-1]
	}
}

// keys reads the keys of up to limit orders after last (nil: from the
// first).
func (r *SQLiteRepository) keys(ctx context.Context, last *orderKey[string], limit int) ([]orderKey[string], error) {
	var rows *sql.Rows
	var err error
	if last == nil {
		rows, err = r.db.QueryContext(ctx, sqliteFirstKeys, limit)
	} else {
		rows, err = r.db.QueryContext(ctx, sqliteNextKeys, last.user, last.created, last.id, limit)
	}
	if err != nil {
		return nil, fmt.Errorf("orders: backfilling events: %w", interpretError(err))
	}
	defer rows.Close()
	var out []orderKey[string]
	for rows.Next() {
		var k orderKey[string]
		if err := rows.Scan(&k.user, &k.created, &k.id); err != nil {
			return nil, fmt.Errorf("orders: backfilling events: %w", interpretError(err))
		}
		out = append(out, k)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("orders: backfilling events: %w", interpretError(err))
	}
	return out, nil
}

// sqliteQuerier is what *sql.DB and *sql.Tx share that sqliteWithoutEvent
// needs.
type sqliteQuerier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// sqliteWithoutEvent returns the order ids of ids whose event is not in
// the outbox.
func sqliteWithoutEvent(ctx context.Context, q sqliteQuerier, ids []string) ([]string, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	list, err := json.Marshal(eventIDs(ids))
	if err != nil {
		return nil, fmt.Errorf("orders: backfilling events: %w", err)
	}
	rows, err := q.QueryContext(ctx, `SELECT id FROM idem_outbox WHERE id IN (SELECT value FROM json_each(?))`, string(list))
	if err != nil {
		return nil, fmt.Errorf("orders: backfilling events: %w", interpretError(err))
	}
	defer rows.Close()
	have := map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, fmt.Errorf("orders: backfilling events: %w", interpretError(err))
		}
		have[id] = true
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("orders: backfilling events: %w", interpretError(err))
	}
	return without(ids, have), nil
}

// addMissingEvents adds the event of each order of ids that still has
// none and is still unmarked, and marks every order of batch (ids among
// them) event_added, in one transaction, and returns how many events it
// added. The mark is checked again under the lock, beside the outbox: an
// order another process backfilled meanwhile may have had its event sent
// and swept already, which the outbox alone would show as missing.
func (r *SQLiteRepository) addMissingEvents(ctx context.Context, ids, batch []string) (int, error) {
	unlock, err := sqlitestore.LockWrites(ctx, r.db) // this process's turn among the database's writers
	if err != nil {
		return 0, fmt.Errorf("orders: backfilling events: %w", err)
	}
	defer unlock()
	tx, err := r.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, fmt.Errorf("orders: backfilling events: begin: %w", interpretError(err))
	}
	defer tx.Rollback()
	// A write first, which matches no row: the transaction takes the write
	// lock (waiting under busy_timeout) before it reads, whatever the
	// pool's _txlock, so its reads cannot go stale before its writes.
	if _, err := tx.ExecContext(ctx, `UPDATE idem_outbox SET attempts = attempts WHERE 0`); err != nil {
		return 0, fmt.Errorf("orders: backfilling events: %w", interpretError(err))
	}
	missing, err := sqliteWithoutEvent(ctx, tx, ids) // another process may have added some
	if err != nil {
		return 0, err
	}
	added := 0
	for _, id := range missing {
		o, err := scanOrder(tx.QueryRowContext(ctx, `SELECT `+orderColumns+` FROM orders WHERE id = ?`, id))
		if err != nil {
			return 0, fmt.Errorf("orders: backfilling the event of order %s: %w", id, err)
		}
		if o.EventAdded {
			// Another process added it and marked the order meanwhile;
			// it may be sent and swept already.
			continue
		}
		if err := addEvent(&o, func(ev outbox.Event) error { return r.outbox.Add(ctx, tx, ev) }); err != nil {
			return 0, err
		}
		added++
	}
	list, err := json.Marshal(batch)
	if err != nil {
		return 0, fmt.Errorf("orders: backfilling events: %w", err)
	}
	if _, err := tx.ExecContext(ctx, `UPDATE orders SET event_added = 1 WHERE id IN (SELECT value FROM json_each(?))`, string(list)); err != nil {
		return 0, fmt.Errorf("orders: backfilling events: marking: %w", interpretError(err))
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("orders: backfilling events: commit: %w", interpretError(err))
	}
	return added, nil
}

// BackfillEvents is SQLiteRepository.BackfillEvents on PostgreSQL: the
// transaction that adds a batch's events holds a transaction-scoped
// advisory lock, so that concurrent callers take turns and each looks up
// what the previous one committed.
func (r *PostgresRepository) BackfillEvents(ctx context.Context, batch int, progress func(added int)) (int, error) {
	without := func(ctx context.Context, ids []string) ([]string, error) { return pgWithoutEvent(ctx, r.pool, ids) }
	return backfill(ctx, batch, progress, r.keys, without, r.addMissingEvents)
}

// keys is SQLiteRepository.keys on PostgreSQL.
func (r *PostgresRepository) keys(ctx context.Context, last *orderKey[time.Time], limit int) ([]orderKey[time.Time], error) {
	var rows pgx.Rows
	var err error
	if last == nil {
		rows, err = r.pool.Query(ctx, pgFirstKeys, limit)
	} else {
		rows, err = r.pool.Query(ctx, pgNextKeys, last.user, last.created, last.id, limit)
	}
	if err != nil {
		return nil, fmt.Errorf("orders: backfilling events: %w", interpretPgError(err))
	}
	keys, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (orderKey[time.Time], error) {
		var k orderKey[time.Time]
		return k, row.Scan(&k.user, &k.created, &k.id)
	})
	if err != nil {
		return nil, fmt.Errorf("orders: backfilling events: %w", interpretPgError(err))
	}
	return keys, nil
}

// pgQuerier is what *pgxpool.Pool and pgx.Tx share that pgWithoutEvent
// needs.
type pgQuerier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// pgWithoutEvent is sqliteWithoutEvent on PostgreSQL.
func pgWithoutEvent(ctx context.Context, q pgQuerier, ids []string) ([]string, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	rows, err := q.Query(ctx, `SELECT id FROM idem_outbox WHERE id = ANY($1)`, eventIDs(ids))
	if err != nil {
		return nil, fmt.Errorf("orders: backfilling events: %w", interpretPgError(err))
	}
	found, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("orders: backfilling events: %w", interpretPgError(err))
	}
	have := make(map[string]bool, len(found))
	for _, id := range found {
		have[id] = true
	}
	return without(ids, have), nil
}

// addMissingEvents is SQLiteRepository.addMissingEvents on PostgreSQL.
func (r *PostgresRepository) addMissingEvents(ctx context.Context, ids, batch []string) (int, error) {
	n := 0
	err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('orders.backfill_events'))`); err != nil {
			return interpretPgError(err)
		}
		missing, err := pgWithoutEvent(ctx, tx, ids) // another instance may have added some
		if err != nil {
			return err
		}
		for _, id := range missing {
			o, err := scanPgOrder(tx.QueryRow(ctx, `SELECT `+orderColumns+` FROM orders WHERE id = $1`, id))
			if err != nil {
				return fmt.Errorf("orders: backfilling the event of order %s: %w", id, err)
			}
			if o.EventAdded {
				continue // as on SQLite
			}
			if err := addEvent(&o, func(ev outbox.Event) error { return r.outbox.Add(ctx, tx, ev) }); err != nil {
				return err
			}
			n++
		}
		if _, err := tx.Exec(ctx, `UPDATE orders SET event_added = true WHERE id = ANY($1)`, batch); err != nil {
			return fmt.Errorf("marking: %w", interpretPgError(err))
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("orders: backfilling events: %w", err)
	}
	return n, nil
}

// addEvent adds the event of o, as read back, through add.
func addEvent(o *Order, add func(outbox.Event) error) error {
	ev, err := EventFor(o)
	if err != nil {
		return err
	}
	if err := add(ev); err != nil {
		return fmt.Errorf("orders: backfilling the event of order %s: %w", o.ID, err)
	}
	return nil
}
