package outbox

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem/pgstore"
)

var _ Table = (*Postgres)(nil)

// Postgres is the outbox table idem_outbox in the PostgreSQL schema that
// the pool's search_path selects. It is safe for concurrent use, and any
// number of instances may Take from one table at once. Make one with
// NewPostgres.
type Postgres struct {
	pool *pgxpool.Pool

	// PublishTimeout bounds how long one Take publishes while it holds its
	// rows' locks (other relays skip those keys meanwhile). Zero:
	// DefaultPublishTimeout. Set it before first use.
	PublishTimeout time.Duration
}

// NewPostgres returns the outbox table reached through pool. Call Migrate
// before first use.
func NewPostgres(pool *pgxpool.Pool) *Postgres { return &Postgres{pool: pool} }

// Migrate creates or upgrades the table. It is idempotent and safe to run
// from several instances at once: see pgstore.ApplyMigrations (one
// transaction under an advisory lock), which records the versions under
// Component.
func (t *Postgres) Migrate(ctx context.Context) error {
	sub, err := fs.Sub(migrations, "migrations/postgres")
	if err != nil {
		return fmt.Errorf("outbox: %w", err)
	}
	if err := pgstore.ApplyMigrations(ctx, t.pool, Component, sub); err != nil {
		return fmt.Errorf("outbox: migrate: %w", err)
	}
	return nil
}

// Add stores e in the caller's transaction tx (a savepoint of pgx.Tx
// works too), which it neither commits nor rolls back: e is published
// once tx commits, and never if it rolls back. An event with the same ID
// returns ErrExists, and tx stays usable (the insert does nothing rather
// than fail); an uncommitted event with the same ID in another
// transaction makes Add wait for that transaction's end.
func (t *Postgres) Add(ctx context.Context, tx pgx.Tx, e Event) error {
	e, err := prepare(e, time.Now())
	if err != nil {
		return err
	}
	tag, err := tx.Exec(ctx, `
		INSERT INTO idem_outbox (id, ordering_key, subject, body, created_at) VALUES ($1, $2, $3, $4, $5)
		ON CONFLICT (id) DO NOTHING`,
		e.ID, e.OrderingKey, e.Subject, e.Body, e.CreatedAt)
	if err != nil {
		return pgError("add "+e.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("%w: %s", ErrExists, e.ID)
	}
	return nil
}

// Take implements Table. Several Takes, of this process or others, run at
// once and share the work. limit < 1 is taken as 1.
//
// A pass reads its window, the oldest unsent events by seq, and locks the
// first event of each key in it (the key's oldest unsent event: the
// window is a prefix of the unsent events) with FOR UPDATE SKIP LOCKED;
// a key whose head another Take holds is skipped, whole. It then
// publishes, in seq order, the window's events of the keys it locked,
// and marks them sent in the same transaction.
//
// Why no other Take publishes one of these keys' events meanwhile, or out
// of order: a Take publishes a key's events only while it holds the lock
// on the key's oldest unsent event, and the lock statement re-reads that
// row's latest version (READ COMMITTED re-evaluates a row that changed
// since its snapshot) and drops it if it was marked sent since the window
// was read. An event is marked sent only by the commit of the Take that
// published it, with the key's other events of that pass, and never
// unmarked. So while Take A holds head h of key K, h is unsent in every
// snapshot: another Take's window starts K at h, and its lock on h is
// skipped; the events after h are never a head. Once A committed, a Take
// whose window was read before sees h unsent but its lock finds h sent and
// skips K; a Take whose window is read after starts K past what A sent.
func (t *Postgres) Take(ctx context.Context, limit int, publish func(ctx context.Context, e Event) error) (int, error) {
	limit = max(limit, 1)
	tx, err := t.pool.Begin(ctx)
	if err != nil {
		return 0, pgError("take: begin", err)
	}
	// After a commit this does nothing; with ctx ended, pgx closes the
	// connection instead, which ends the transaction as well.
	defer tx.Rollback(context.WithoutCancel(ctx))
	rows, err := tx.Query(ctx, `SELECT id, ordering_key FROM idem_outbox WHERE sent_at IS NULL ORDER BY seq LIMIT $1`,
		windowFactor*limit)
	if err != nil {
		return 0, pgError("take: window", err)
	}
	window, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (windowRow, error) {
		var w windowRow
		err := r.Scan(&w.id, &w.key)
		return w, err
	})
	if err != nil {
		return 0, pgError("take: window", err)
	}
	if len(window) == 0 {
		return 0, nil
	}
	rows, err = tx.Query(ctx, `
		SELECT ordering_key FROM idem_outbox WHERE id = ANY($1) AND sent_at IS NULL
		ORDER BY seq LIMIT $2 FOR UPDATE SKIP LOCKED`, heads(window), limit)
	if err != nil {
		return 0, pgError("take: lock", err)
	}
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return 0, pgError("take: lock", err)
	}
	if len(keys) == 0 {
		return 0, nil // every key in the window is another Take's
	}
	held := make(map[string]bool, len(keys))
	for _, k := range keys {
		held[k] = true
	}
	ids := choose(window, held, limit)
	rows, err = tx.Query(ctx, `
		SELECT id, ordering_key, subject, body, created_at FROM idem_outbox WHERE id = ANY($1) ORDER BY seq`, ids)
	if err != nil {
		return 0, pgError("take: read", err)
	}
	events, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Event, error) {
		var e Event
		err := r.Scan(&e.ID, &e.OrderingKey, &e.Subject, &e.Body, &e.CreatedAt)
		return e, err
	})
	if err != nil {
		return 0, pgError("take: read", err)
	}
	attempted, sent, pubErr := publishAll(ctx, t.PublishTimeout, events, publish)
	if _, err := tx.Exec(ctx, `
		UPDATE idem_outbox SET attempts = attempts + 1,
			sent_at = CASE WHEN id = ANY($2) THEN now() END
		WHERE id = ANY($1) AND sent_at IS NULL`, attempted, sent); err != nil {
		return 0, errors.Join(pgError("take: mark", err), pubErr)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, errors.Join(pgError("take: commit", err), pubErr)
	}
	return len(sent), pubErr
}

// Unsent implements Table.
func (t *Postgres) Unsent(ctx context.Context) (int, error) {
	var n int
	if err := t.pool.QueryRow(ctx, `SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL`).Scan(&n); err != nil {
		return 0, pgError("unsent", err)
	}
	return n, nil
}

// Each implements Table. It reads the table in pages by seq, so fn sees
// the events committed before its page was read.
func (t *Postgres) Each(ctx context.Context, fn func(e Event, sentAt time.Time) error) error {
	type row struct {
		seq    int64
		e      Event
		sentAt *time.Time
	}
	var after int64
	for {
		rows, err := t.pool.Query(ctx, `
			SELECT seq, id, ordering_key, subject, body, created_at, sent_at FROM idem_outbox
			WHERE seq > $1 ORDER BY seq LIMIT $2`, after, eachPage)
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
		if len(page) < eachPage {
			return nil
		}
	}
}

// pgError translates the driver's errors, once, at the edge: a unique
// violation (SQLSTATE 23505) is ErrExists, everything else is wrapped.
func pgError(op string, err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "23505" {
		return fmt.Errorf("%w: %s: %v", ErrExists, op, err)
	}
	return fmt.Errorf("outbox: %s: %w", op, err)
}
