package pgoutbox

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/outbox/internal/take"
	"github.com/idem-go/idem/pgstore"
)

var (
	_ outbox.Table   = (*Table)(nil)
	_ outbox.Sweeper = (*Table)(nil)
)

//go:embed migrations/*.sql
var migrations embed.FS

// Table is the outbox table idem_outbox in the PostgreSQL schema that
// the pool's search_path selects. It is safe for concurrent use, and any
// number of instances may Take from one table at once. Make one with
// New.
type Table struct {
	pool *pgxpool.Pool
	mode pgx.QueryExecMode // of the table's statements: see New

	mu      sync.Mutex // guards cursor and started
	cursor  string     // the last key a pass locked: the next pass starts after it
	started bool       // cursor is set

	// PublishTimeout bounds how long one Take publishes while it holds its
	// rows' locks (other relays skip those keys meanwhile). Zero:
	// outbox.DefaultPublishTimeout. Set it before first use.
	PublishTimeout time.Duration
}

// New returns the outbox table reached through pool. Call Migrate
// before first use.
//
// Its statements are sent in pgstore.StatementMode, as pgstore's are: no
// named prepared statement, so the table works behind PgBouncer in
// transaction mode on a pool with pgx's default settings, and nothing
// depends on the session's client_encoding.
func New(pool *pgxpool.Pool) *Table {
	return &Table{pool: pool, mode: pgstore.StatementMode(pool)}
}

// Migrate creates or upgrades the table. It is idempotent and safe to run
// from several instances at once: see pgstore.ApplyMigrations (one
// transaction under an advisory lock), which records the versions under
// outbox.Component.
func (t *Table) Migrate(ctx context.Context) error {
	sub, err := fs.Sub(migrations, "migrations")
	if err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	if err := pgstore.ApplyMigrations(ctx, t.pool, outbox.Component, sub); err != nil {
		return fmt.Errorf("outbox: migrate: %w", err)
	}
	return nil
}

// Pending returns the table's migrations that the schema the pool's
// search_path selects has not applied (by file name, in version order;
// all of them before the first Migrate, none after the last), reading
// only: see pgstore.PendingMigrations.
func (t *Table) Pending(ctx context.Context) ([]string, error) {
	sub, err := fs.Sub(migrations, "migrations")
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	pending, err := pgstore.PendingMigrations(ctx, t.pool, outbox.Component, sub)
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	return pending, nil
}

// Add stores e in the caller's transaction tx (a savepoint of pgx.Tx
// works too), which it neither commits nor rolls back: e is published
// once tx commits, and never if it rolls back. An event with the same ID
// returns outbox.ErrExists, and tx stays usable (the insert does nothing rather
// than fail); an uncommitted event with the same ID in another
// transaction makes Add wait for that transaction's end.
//
// Add first takes a transaction-level advisory lock on e's ordering key
// (pg_advisory_xact_lock, held until tx ends, even when a savepoint rolls
// back): transactions that add events of one key run their Adds one after
// the other, so a key's seq order is the order of their commits, and an
// event never becomes visible behind a later one of its key that a relay
// may already be publishing. Two transactions that add events of the same
// keys in opposite orders may deadlock (PostgreSQL then aborts one, after
// keyLockPolling).
//
// The lock is tried, not waited for, during its first keyLockPolling: a
// transaction waiting for it in the server is not idle, so
// idle_in_transaction_session_timeout does not end it, and when the
// holder's client is cut off (a network partition, an instance frozen),
// every transaction of that client queued behind it would take the lock
// in turn and then sit idle in it for the whole timeout: N of them held
// the key for N timeouts. A transaction that waits between tries on the
// client side is idle, so a client cut off has all of its transactions
// ended by the timeout at once. After keyLockPolling, Add waits in the
// server, where deadlocks are detected.
func (t *Table) Add(ctx context.Context, tx pgx.Tx, e outbox.Event) error {
	e, err := take.Prepare(e, time.Now())
	if err != nil {
		return err
	}
	if err := t.lockKey(ctx, tx, e.OrderingKey); err != nil {
		return pgError("add "+e.ID+": key lock", err)
	}
	tag, err := tx.Exec(ctx, `
		INSERT INTO idem_outbox (id, ordering_key, subject, body, created_at) VALUES ($1, $2, $3, $4, $5)
		ON CONFLICT (id) DO NOTHING`,
		t.mode, e.ID, e.OrderingKey, e.Subject, e.Body, e.CreatedAt)
	if err != nil {
		return pgError("add "+e.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: %s", outbox.ErrExists, e.ID)
	}
	return nil
}

// keyLockPolling is how long Add tries its key's lock, pausing between
// tries, before it waits for it in the server; keyLockMaxPause bounds a
// pause.
const (
	keyLockPolling  = 500 * time.Millisecond
	keyLockMaxPause = 20 * time.Millisecond
)

// lockKey takes the transaction-level advisory lock of ordering key key
// in tx (see Add).
func (t *Table) lockKey(ctx context.Context, tx pgx.Tx, key string) error {
	deadline := time.Now().Add(keyLockPolling)
	for pause := 500 * time.Microsecond; time.Now().Before(deadline); pause = min(2*pause, keyLockMaxPause) {
		var got bool
		if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock(hashtext('idem_outbox'), hashtext($1))`, t.mode, key).Scan(&got); err != nil {
			return err
		}
		if got {
			return nil
		}
		timer := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			timer.Stop()
			return ctx.Err()
		case <-timer.C:
		}
	}
	_, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('idem_outbox'), hashtext($1))`, t.mode, key)
	return err
}

// pgHeadsQuery returns the statement that locks the heads of up to $2
// keys (each key's oldest unsent event), walking the keys with unsent
// events in key order from $1 (after it, or from it when from is ">="),
// up to $3 when bounded, and skipping the heads another Take holds.
//
// The walk is a loose index scan of idem_outbox_unsent_key: each step
// reads the first entry of the next key, which is that key's head (its
// smallest unsent seq), so a pass reads about as many index entries as it
// locks, whether the backlog is spread over many keys or held by a few.
// OFFSET 0 keeps the lock's subquery apart, so that the rows are read and
// locked one key at a time and the walk stops at the LIMIT.
func pgHeadsQuery(from string, bounded bool) string {
	bound := ""
	if bounded {
		bound = " AND ordering_key <= $3"
	}
	return `
	WITH RECURSIVE k(ordering_key, seq) AS (
		(SELECT ordering_key, seq FROM idem_outbox
		 WHERE sent_at IS NULL AND ordering_key ` + from + ` $1` + bound + `
		 ORDER BY ordering_key, seq LIMIT 1)
		UNION ALL
		SELECT n.ordering_key, n.seq FROM k CROSS JOIN LATERAL (
			SELECT ordering_key, seq FROM idem_outbox
			WHERE sent_at IS NULL AND ordering_key > k.ordering_key` + bound + `
			ORDER BY ordering_key, seq LIMIT 1) AS n
	)
	SELECT h.id, h.ordering_key, h.subject, h.body, h.created_at, h.seq
	FROM k CROSS JOIN LATERAL (
		SELECT id, ordering_key, subject, body, created_at, seq FROM idem_outbox
		WHERE seq = k.seq AND sent_at IS NULL OFFSET 0) AS h
	LIMIT $2
	FOR UPDATE OF h SKIP LOCKED`
}

var (
	pgHeadsAfter   = pgHeadsQuery(">", false)  // $1 cursor, $2 limit
	pgHeadsAll     = pgHeadsQuery(">=", false) // $1 "", $2 limit
	pgHeadsWrapped = pgHeadsQuery(">=", true)  // $1 "", $2 limit, $3 cursor
)

// pgFollowersQuery reads and locks, for each held key ($1) and its head's
// seq ($2), the unsent events after the head, at most $3 in all, by seq.
// The lock waits rather than skips: such an event is locked by another
// Take only if that Take holds an older head of the key, one committed
// after this pass's head (Add's key lock rules that out), and once that
// Take commits, the rows it sent are re-checked and dropped.
const pgFollowersQuery = `
	SELECT f.id, f.ordering_key, f.subject, f.body, f.created_at, f.seq
	FROM unnest($1::text[], $2::bigint[]) AS h(ordering_key, seq)
	CROSS JOIN LATERAL (
		SELECT id, ordering_key, subject, body, created_at, seq FROM idem_outbox
		WHERE ordering_key = h.ordering_key AND sent_at IS NULL AND seq > h.seq
		ORDER BY ordering_key, seq LIMIT $3) AS f
	ORDER BY f.seq
	LIMIT $3
	FOR UPDATE OF f`

// Take implements Table. Several Takes, of this process or others, run at
// once and share the work. limit < 1 is taken as 1.
//
// A pass locks the heads of up to limit keys (pgHeadsQuery: FOR UPDATE
// SKIP LOCKED), holding those keys, taking the keys in turn (in key order,
// from where this value's previous pass stopped); then, while the batch
// has room, it reads the events that follow the heads in their keys, and
// publishes them all in seq order.
//
// Why no other Take publishes one of these keys' events meanwhile, or out
// of order: a Take publishes a key's events only while it holds the lock
// on the key's head, the event with the key's smallest seq among those
// its statement's snapshot sees unsent. An event is marked sent only by
// the commit of the Take that published it, together with the rest of its
// pass, and never unmarked. So while Take A holds head h of key K, h is
// unsent in every snapshot, and is K's head in every one: another Take's
// walk finds h, and SKIP LOCKED skips it (it does not move on to K's next
// event, which is never a head). When A has committed after another
// Take's snapshot was taken, that Take's walk still finds h, but its FOR
// UPDATE re-reads h's latest version and re-checks sent_at IS NULL on it
// (READ COMMITTED's re-evaluation of a row changed since the snapshot): h
// is dropped, and K skipped in this pass. An event added to K after its
// head had committed has a larger seq.
func (t *Table) Take(ctx context.Context, limit int, publish func(ctx context.Context, e outbox.Event) error) (int, error) {
	limit = max(limit, 1)
	tx, err := t.pool.Begin(ctx)
	if err != nil {
		return 0, pgError("take: begin", err)
	}
	// After a commit this does nothing; with ctx ended, pgx closes the
	// connection instead, which ends the transaction as well.
	defer tx.Rollback(context.WithoutCancel(ctx))
	hs, err := t.lockHeads(ctx, tx, limit)
	if err != nil {
		return 0, pgError("take: heads", err)
	}
	if len(hs) == 0 {
		return 0, nil
	}
	if room := limit - len(hs); room > 0 {
		keys := make([]string, len(hs))
		seqs := make([]int64, len(hs))
		for i, h := range hs {
			keys[i], seqs[i] = h.OrderingKey, h.Seq
		}
		fs, err := pgSeqEvents(ctx, tx, pgFollowersQuery, t.mode, keys, seqs, room)
		if err != nil {
			return 0, pgError("take: followers", err)
		}
		hs = append(hs, fs...)
	}
	attempted, sent, pubErr := take.PublishAll(ctx, t.PublishTimeout, take.InOrder(hs), publish)
	if _, err := tx.Exec(ctx, `
		UPDATE idem_outbox SET attempts = attempts + 1,
			sent_at = CASE WHEN id = ANY($2) THEN now() END
		WHERE id = ANY($1) AND sent_at IS NULL`, t.mode, attempted, sent); err != nil {
		return 0, errors.Join(pgError("take: mark", err), pubErr)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, errors.Join(pgError("take: commit", err), pubErr)
	}
	return len(sent), pubErr
}

// lockHeads locks the heads of up to limit keys, walking the keys from
// where the previous pass of t stopped and around, so that every key gets
// its turn however many there are.
func (t *Table) lockHeads(ctx context.Context, tx pgx.Tx, limit int) ([]take.Seq, error) {
	t.mu.Lock()
	cursor, started := t.cursor, t.started
	t.mu.Unlock()
	var (
		hs  []take.Seq
		err error
	)
	if !started {
		hs, err = pgSeqEvents(ctx, tx, pgHeadsAll, t.mode, "", limit)
	} else {
		hs, err = pgSeqEvents(ctx, tx, pgHeadsAfter, t.mode, cursor, limit)
		if err == nil && len(hs) < limit {
			var more []take.Seq
			more, err = pgSeqEvents(ctx, tx, pgHeadsWrapped, t.mode, "", limit-len(hs), cursor)
			hs = append(hs, more...)
		}
	}
	if err != nil || len(hs) == 0 {
		return nil, err
	}
	t.mu.Lock()
	t.cursor, t.started = hs[len(hs)-1].OrderingKey, true
	t.mu.Unlock()
	return hs, nil
}

// pgSeqEvents runs query, which selects id, ordering_key, subject, body,
// created_at and seq, in tx; args begin with the query mode.
func pgSeqEvents(ctx context.Context, tx pgx.Tx, query string, args ...any) ([]take.Seq, error) {
	rows, err := tx.Query(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (take.Seq, error) {
		var e take.Seq
		err := r.Scan(&e.ID, &e.OrderingKey, &e.Subject, &e.Body, &e.CreatedAt, &e.Seq)
		return e, err
	})
}

// Unsent implements Table.
func (t *Table) Unsent(ctx context.Context) (int, error) {
	var n int
	if err := t.pool.QueryRow(ctx, `SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL`, t.mode).Scan(&n); err != nil {
		return 0, pgError("unsent", err)
	}
	return n, nil
}

// Each implements Table. It reads the table in pages by seq, so fn sees
// the events committed before its page was read.
func (t *Table) Each(ctx context.Context, fn func(e outbox.Event, sentAt time.Time) error) error {
	type row struct {
		seq    int64
		e      outbox.Event
		sentAt *time.Time
	}
	var after int64
	for {
		rows, err := t.pool.Query(ctx, `
			SELECT seq, id, ordering_key, subject, body, created_at, sent_at FROM idem_outbox
			WHERE seq > $1 ORDER BY seq LIMIT $2`, t.mode, after, take.EachPage)
		if err != nil {
			return pgError("each", err)
		}
		page, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
			var x row
			err := r.Scan(&x.seq, &x.e.ID, &x.e.OrderingKey, &x.e.Subject, &x.e.Body, &x.e.CreatedAt, &x.sentAt)
			return x, err
		})
		if err != nil {
			return pgError("each", err)
		}
		for _, x := range page {
			after = x.seq
			var sentAt time.Time
			if x.sentAt != nil {
				sentAt = *x.sentAt
			}
			if err := fn(x.e, sentAt); err != nil {
				return err
			}
		}
		if len(page) < take.EachPage {
			return nil
		}
	}
}

// DeleteSent implements outbox.Sweeper. It deletes in one statement, by
// the index on sent_at, and Take never locks a sent event: it waits for
// no relay, nor a relay for it. sent_at is the database's clock when the
// event was marked.
func (t *Table) DeleteSent(ctx context.Context, sentBefore time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("outbox: delete sent: limit %d, want at least 1", limit)
	}
	tag, err := t.pool.Exec(ctx, `
		DELETE FROM idem_outbox WHERE id IN (
			SELECT id FROM idem_outbox WHERE sent_at < $1 ORDER BY sent_at LIMIT $2)`,
		t.mode, sentBefore, limit)
	if err != nil {
		return 0, pgError("delete sent", err)
	}
	return int(tag.RowsAffected()), nil
}

// pgError translates the driver's errors, once, at the edge: a unique
// violation (SQLSTATE 23505) is outbox.ErrExists, everything else is wrapped.
func pgError(op string, err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "23505" {
		return fmt.Errorf("%w: %s: %v", outbox.ErrExists, op, err)
	}
	return fmt.Errorf("outbox: %s: %w", op, err)
}
