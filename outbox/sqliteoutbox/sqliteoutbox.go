package sqliteoutbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"time"

	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/outbox/internal/take"
	"github.com/idem-go/idem/sqlitestore"
)

var (
	_ outbox.Table   = (*Table)(nil)
	_ outbox.Sweeper = (*Table)(nil)
)

//go:embed migrations/*.sql
var migrations embed.FS

// Table is the outbox table idem_outbox in a SQLite database (the
// modernc.org/sqlite driver), typically the one the service's own tables
// and sqlitestore's keys live in, so that an event commits with them. It
// is safe for concurrent use. Make one with New.
type Table struct {
	db     *sql.DB
	cursor string // the last key a Take handled: the next one starts after it (guarded by db's write queue)
	// started: cursor is set (guarded by db's write queue)
	started bool

	// PublishTimeout bounds how long one Take publishes while it holds
	// SQLite's write lock (every other writer of the database waits for
	// it meanwhile). Zero: outbox.DefaultPublishTimeout. Set it before first use.
	PublishTimeout time.Duration
}

// New returns the outbox table in db. Call Migrate before first use. Give
// it the pool the rest of the process writes through (a
// sqlitestore.Store's DB()): Take waits in that pool's write queue
// (sqlitestore.LockWrites), and a table on a pool of its own would be kept
// apart from the store's writers only by SQLite's lock, which hands it
// over by polling.
func New(db *sql.DB) *Table { return &Table{db: db} }

// Migrate creates or upgrades the table. It is idempotent and safe to run
// from several processes at once: see sqlitestore.ApplyMigrations, which
// records the versions under outbox.Component.
func (t *Table) Migrate(ctx context.Context) error {
	sub, err := fs.Sub(migrations, "migrations")
	if err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	if err := sqlitestore.ApplyMigrations(ctx, t.db, outbox.Component, sub); err != nil {
		return fmt.Errorf("outbox: migrate: %w", err)
	}
	return nil
}

// Pending returns the table's migrations that db has not applied (by
// file name, in version order; all of them before the first Migrate, none
// after the last), reading only: see sqlitestore.PendingMigrations.
func (t *Table) Pending(ctx context.Context) ([]string, error) {
	sub, err := fs.Sub(migrations, "migrations")
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	pending, err := sqlitestore.PendingMigrations(ctx, t.db, outbox.Component, sub)
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	return pending, nil
}

// Tx is the caller's transaction, as Add needs it: a *sql.Tx, or
// the transaction of an idempotent request as sqlitestore.FromContext
// hands it to the handler (*sqlitestore.HandlerTx).
type Tx interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// Add stores e in the caller's transaction tx, which it neither commits
// nor rolls back: e is published once tx commits, and never if it rolls
// back. Its seq is the largest one plus one, read and written under tx's
// write lock. An event with the same ID returns outbox.ErrExists, and tx stays
// usable.
func (t *Table) Add(ctx context.Context, tx Tx, e outbox.Event) error {
	e, err := take.Prepare(e, time.Now())
	if err != nil {
		return err
	}
	// WHERE true: an INSERT … SELECT needs a WHERE before ON CONFLICT,
	// which SQLite would otherwise read as a join's ON.
	res, err := tx.ExecContext(ctx, `
		INSERT INTO idem_outbox (id, seq, ordering_key, subject, body, created_at)
		SELECT ?, coalesce(max(seq), 0) + 1, ?, ?, ?, ? FROM idem_outbox WHERE true
		ON CONFLICT (id) DO NOTHING`,
		e.ID, e.OrderingKey, e.Subject, e.Body, e.CreatedAt.UnixNano())
	if err != nil {
		return sqliteError("add "+e.ID, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return sqliteError("add "+e.ID, err)
	}
	if n == 0 {
		return fmt.Errorf("%w: %s", outbox.ErrExists, e.ID)
	}
	return nil
}

// sqliteNextHead selects the head (oldest unsent event) of the first key
// after ? with unsent events: one step of a loose index scan of
// idem_outbox_unsent_key.
const sqliteNextHead = `
	SELECT id, ordering_key, subject, body, created_at, seq FROM idem_outbox
	WHERE sent_at IS NULL AND ordering_key > ?
	ORDER BY ordering_key, seq LIMIT 1`

// sqliteFirstHead is sqliteNextHead from the first key on.
const sqliteFirstHead = `
	SELECT id, ordering_key, subject, body, created_at, seq FROM idem_outbox
	WHERE sent_at IS NULL
	ORDER BY ordering_key, seq LIMIT 1`

// sqliteFollowersQuery selects, by seq, up to ? unsent events of one key
// after its head's seq.
const sqliteFollowersQuery = `
	SELECT id, ordering_key, subject, body, created_at, seq FROM idem_outbox
	WHERE ordering_key = ? AND sent_at IS NULL AND seq > ?
	ORDER BY seq
	LIMIT ?`

// Take implements Table. A Take that finds no unsent event (a read, which
// in WAL mode waits for no writer) returns 0 without taking the write
// lock, so an idle relay does not hold up the database's writers. Else it
// waits for its turn in db's write queue, with the process's other
// writers (sqlitestore.LockWrites: the store's claims and handler
// transactions), and then holds SQLite's write lock from its BEGIN
// IMMEDIATE (waiting for writers of other processes under the
// connection's busy_timeout) to its commit, publishing in between: one
// Take runs at a time over the database, and PublishTimeout also bounds
// how long the other writers wait for it. limit < 1 is taken as 1.
//
// Holding the write lock, a pass reads the heads (oldest unsent events)
// of up to limit keys, taking the keys in turn (in key order, from where
// the previous pass stopped), then, while the batch has room, the events
// that follow the heads in their keys, and publishes them all in seq
// order.
func (t *Table) Take(ctx context.Context, limit int, publish func(ctx context.Context, e outbox.Event) error) (n int, err error) {
	limit = max(limit, 1)
	var unsent int
	if err := t.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM idem_outbox WHERE sent_at IS NULL)`).Scan(&unsent); err != nil {
		return 0, sqliteError("take: any unsent", err)
	}
	if unsent == 0 {
		return 0, nil
	}
	unlock, err := sqlitestore.LockWrites(ctx, t.db)
	if err != nil {
		return 0, fmt.Errorf("outbox: take: %w", err)
	}
	defer unlock()
	conn, err := t.db.Conn(ctx)
	if err != nil {
		return 0, sqliteError("take", err)
	}
	defer conn.Close()
	// BEGIN IMMEDIATE on the connection itself, whatever the pool's
	// _txlock: the write lock is taken before the read, so no other
	// relay reads the same events meanwhile.
	if _, err := conn.ExecContext(ctx, `BEGIN IMMEDIATE`); err != nil {
		return 0, sqliteError("take: begin", err)
	}
	done := false
	defer func() {
		if !done {
			rollbackConn(ctx, conn)
		}
	}()
	hs, err := t.heads(ctx, conn, limit)
	if err != nil {
		return 0, sqliteError("take: heads", err)
	}
	es := slices.Clone(hs)
	for _, h := range hs {
		room := limit - len(es)
		if room <= 0 {
			break
		}
		fs, err := sqliteSeqEvents(ctx, conn, sqliteFollowersQuery, h.OrderingKey, h.Seq, room)
		if err != nil {
			return 0, sqliteError("take: followers", err)
		}
		es = append(es, fs...)
	}
	attempted, sent, pubErr := take.PublishAll(ctx, t.PublishTimeout, take.InOrder(es), publish)
	now := time.Now().UnixNano()
	isSent := make(map[string]bool, len(sent))
	for _, id := range sent {
		isSent[id] = true
	}
	for _, id := range attempted {
		var at any // NULL: publish failed, the event stays unsent
		if isSent[id] {
			at = now
		}
		if _, err := conn.ExecContext(ctx,
			`UPDATE idem_outbox SET attempts = attempts + 1, sent_at = ? WHERE id = ? AND sent_at IS NULL`,
			at, id); err != nil {
			return 0, errors.Join(sqliteError("take: mark", err), pubErr)
		}
	}
	done = true
	if _, err := conn.ExecContext(ctx, `COMMIT`); err != nil {
		rollbackConn(ctx, conn)
		return 0, errors.Join(sqliteError("take: commit", err), pubErr)
	}
	return len(sent), pubErr
}

// heads returns the heads of up to limit keys, walking the keys in key
// order from where the previous pass stopped and around, so that every
// key gets its turn however many there are. The caller holds db's write
// queue.
func (t *Table) heads(ctx context.Context, conn *sql.Conn, limit int) ([]take.Seq, error) {
	var hs []take.Seq
	query, arg := sqliteNextHead, any(t.cursor)
	if !t.started {
		query, arg = sqliteFirstHead, nil
	}
	wrapped := !t.started
	for len(hs) < limit {
		args := []any{}
		if arg != nil {
			args = append(args, arg)
		}
		h, err := sqliteSeqEvents(ctx, conn, query, args...)
		if err != nil {
			return nil, err
		}
		if len(h) == 0 || (wrapped && t.started && h[0].OrderingKey > t.cursor) {
			if wrapped {
				break
			}
			// Around, from the first key up to the cursor.
			wrapped = true
			query, arg = sqliteFirstHead, nil
			continue
		}
		hs = append(hs, h[0])
		query, arg = sqliteNextHead, h[0].OrderingKey
	}
	if len(hs) > 0 {
		t.cursor, t.started = hs[len(hs)-1].OrderingKey, true
	}
	return hs, nil
}

// sqliteSeqEvents runs query, which selects id, ordering_key, subject,
// body, created_at and seq, on conn.
func sqliteSeqEvents(ctx context.Context, conn *sql.Conn, query string, args ...any) ([]take.Seq, error) {
	rows, err := conn.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var es []take.Seq
	for rows.Next() {
		var (
			e       take.Seq
			created int64
		)
		if err := rows.Scan(&e.ID, &e.OrderingKey, &e.Subject, &e.Body, &created, &e.Seq); err != nil {
			return nil, err
		}
		e.CreatedAt = time.Unix(0, created)
		es = append(es, e)
	}
	return es, rows.Err()
}

// rollbackConn ends the transaction open on conn. ctx may have ended
// (that may be why it is rolled back), so the ROLLBACK runs without it; a
// connection that cannot roll back is discarded rather than returned to
// the pool inside a transaction.
func rollbackConn(ctx context.Context, conn *sql.Conn) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_, err := conn.ExecContext(rctx, `ROLLBACK`)
	if err == nil || strings.Contains(err.Error(), "no transaction is active") {
		return
	}
	_ = conn.Raw(func(any) error { return driver.ErrBadConn }) // the pool closes it
}

// Unsent implements Table.
func (t *Table) Unsent(ctx context.Context) (int, error) {
	var n int
	if err := t.db.QueryRowContext(ctx, `SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL`).Scan(&n); err != nil {
		return 0, sqliteError("unsent", err)
	}
	return n, nil
}

// Each implements Table. It reads the table in pages by seq, so fn sees
// the events committed before its page was read, and runs outside the
// read.
func (t *Table) Each(ctx context.Context, fn func(e outbox.Event, sentAt time.Time) error) error {
	var after int64
	for {
		page, err := t.page(ctx, after)
		if err != nil {
			return err
		}
		for _, r := range page {
			if err := fn(r.e, r.sentAt); err != nil {
				return err
			}
			after = r.seq
		}
		if len(page) < take.EachPage {
			return nil
		}
	}
}

// eachRow is one event as Each reads it.
type eachRow struct {
	seq    int64
	e      outbox.Event
	sentAt time.Time
}

// page returns up to take.EachPage events whose seq is above after, by seq.
func (t *Table) page(ctx context.Context, after int64) ([]eachRow, error) {
	rows, err := t.db.QueryContext(ctx, `
		SELECT seq, id, ordering_key, subject, body, created_at, sent_at FROM idem_outbox
		WHERE seq > ? ORDER BY seq LIMIT ?`, after, take.EachPage)
	if err != nil {
		return nil, sqliteError("each", err)
	}
	defer rows.Close()
	var page []eachRow
	for rows.Next() {
		var (
			r       eachRow
			created int64
			sent    sql.NullInt64
		)
		if err := rows.Scan(&r.seq, &r.e.ID, &r.e.OrderingKey, &r.e.Subject, &r.e.Body, &created, &sent); err != nil {
			return nil, sqliteError("each", err)
		}
		r.e.CreatedAt = time.Unix(0, created)
		if sent.Valid {
			r.sentAt = time.Unix(0, sent.Int64)
		}
		page = append(page, r)
	}
	if err := rows.Err(); err != nil {
		return nil, sqliteError("each", err)
	}
	return page, nil
}

// DeleteSent implements outbox.Sweeper, in one statement by the index on
// sent_at. sent_at is the clock of the process that marked the event.
func (t *Table) DeleteSent(ctx context.Context, sentBefore time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("outbox: delete sent: limit %d, want at least 1", limit)
	}
	res, err := t.db.ExecContext(ctx, `
		DELETE FROM idem_outbox WHERE id IN (
			SELECT id FROM idem_outbox WHERE sent_at IS NOT NULL AND sent_at < ? ORDER BY sent_at LIMIT ?)`,
		sentBefore.UnixNano(), limit)
	if err != nil {
		return 0, sqliteError("delete sent", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, sqliteError("delete sent", err)
	}
	return int(n), nil
}

// sqliteError translates the driver's errors, once, at the edge: a
// unique violation is outbox.ErrExists, everything else is wrapped.
func sqliteError(op string, err error) error {
	var se *sqlite.Error
	if errors.As(err, &se) {
		switch se.Code() {
		case sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY, sqlite3.SQLITE_CONSTRAINT_UNIQUE:
			return fmt.Errorf("%w: %s: %v", outbox.ErrExists, op, err)
		}
	}
	return fmt.Errorf("outbox: %s: %w", op, err)
}
