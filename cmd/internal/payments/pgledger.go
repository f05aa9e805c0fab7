package payments

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

var _ Ledger = (*PGLedger)(nil)

// PGLedger is a Ledger in the PostgreSQL tables payment_intents and
// refunds (see MigratePostgres), for a gateway whose idempotency store is
// a pgstore.Store on the same database and schema: inside an idempotent
// request it writes through the store's transaction (pgstore.FromContext),
// so a PaymentIntent commits together with the stored response, fenced on
// the request's lease, or not at all. It is safe for concurrent use.
type PGLedger struct {
	pool *pgxpool.Pool
	// intents and refunds are the tables' names in statements: qualified
	// with the ledger's schema, or bare without one.
	intents, refunds string
}

// NewPGLedger returns the ledger in the tables of pool's database in
// schema, which every statement names, so that the pool's search_path
// plays no part; with schema "", in the schema that pool's search_path
// selects. It does not create the tables: call MigratePostgres (or
// OpenPostgres) first. It reads, and writes requests without an
// idempotency key, through pool, which should be the idempotency store's.
func NewPGLedger(pool *pgxpool.Pool, schema string) *PGLedger {
	l := &PGLedger{pool: pool, intents: "payment_intents", refunds: "refunds"}
	if schema != "" {
		l.intents = pgx.Identifier{schema, l.intents}.Sanitize()
		l.refunds = pgx.Identifier{schema, l.refunds}.Sanitize()
	}
	return l
}

// MigratePostgres creates or upgrades the ledger's tables in schema,
// which it creates if it does not exist, and records their migrations
// there under Component (pgstore.ApplyMigrationsSchema: the pool's
// search_path plays no part); with schema "", in the schema that pool's
// search_path selects. It is safe to call from several processes at once.
func MigratePostgres(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	return pgstore.ApplyMigrationsSchema(ctx, pool, schema, Component, migrationsFor("postgres"))
}

// Create implements Ledger. Inside an idempotent request the row is
// written in the request's pgstore transaction, and commits with its
// outcome; a request of another store's is ErrForeignTx. Without one it is
// written at once. Like a real gateway the write does not heed the
// cancellation of ctx.
func (l *PGLedger) Create(ctx context.Context, pi *PaymentIntent) error {
	args, err := piValues(pi)
	if err != nil {
		return err
	}
	var db interface {
		Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	}
	itx, err := idem.TxFromContext(ctx)
	switch {
	case errors.Is(err, idem.ErrNoTx):
		db = l.pool
	case err != nil:
		return fmt.Errorf("payments: joining the idempotent transaction: %w", err)
	default:
		if _, ok := idemdriver.UnwrapTx(itx).(*pgstore.Tx); !ok {
			return fmt.Errorf("%w: the PostgreSQL ledger needs a pgstore transaction, not %T", ErrForeignTx, idemdriver.UnwrapTx(itx))
		}
		tx, err := pgstore.FromContext(ctx)
		if err != nil {
			return fmt.Errorf("payments: joining the idempotent transaction: %w", err)
		}
		db = tx
	}
	insert := `INSERT INTO ` + l.intents + ` (` + piColumns + `)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)`
	if _, err := db.Exec(context.WithoutCancel(ctx), insert, args...); err != nil {
		return fmt.Errorf("payments: recording %s: %w", pi.ID, err)
	}
	return nil
}

// Get implements Ledger.
func (l *PGLedger) Get(ctx context.Context, account, id string) (*PaymentIntent, error) {
	if !storable(id) { // PostgreSQL would refuse it (SQLSTATE 22021): it names nothing
		return nil, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	pi, err := scanPI(l.pool.QueryRow(ctx, `SELECT `+piColumns+` FROM `+l.intents+` WHERE id = $1 AND account = $2`, id, account))
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return nil, fmt.Errorf("%w: %s", ErrNotFound, id)
	case err != nil:
		return nil, fmt.Errorf("payments: get %s: %w", id, err)
	}
	return pi, nil
}

// List implements Ledger: newest first by the time each row was written,
// the id breaking ties, by key set.
func (l *PGLedger) List(ctx context.Context, q ListQuery) (Page, error) {
	limit := q.limit()
	var (
		rows pgx.Rows
		at   time.Time
		err  error
	)
	switch {
	case q.EndingBefore != "":
		if at, err = l.cursor(ctx, q.Account, q.EndingBefore); err != nil {
			return Page{}, err
		}
		rows, err = l.pool.Query(ctx, `SELECT `+piColumns+` FROM `+l.intents+`
WHERE account = $1 AND (created_at, id) > ($2, $3)
ORDER BY created_at, id LIMIT $4`, q.Account, at, q.EndingBefore, limit+1)
	case q.StartingAfter != "":
		if at, err = l.cursor(ctx, q.Account, q.StartingAfter); err != nil {
			return Page{}, err
		}
		rows, err = l.pool.Query(ctx, `SELECT `+piColumns+` FROM `+l.intents+`
WHERE account = $1 AND (created_at, id) < ($2, $3)
ORDER BY created_at DESC, id DESC LIMIT $4`, q.Account, at, q.StartingAfter, limit+1)
	default:
		rows, err = l.pool.Query(ctx, `SELECT `+piColumns+` FROM `+l.intents+`
WHERE account = $1
ORDER BY created_at DESC, id DESC LIMIT $2`, q.Account, limit+1)
	}
	if err != nil {
		return Page{}, fmt.Errorf("payments: list: %w", err)
	}
	pis, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (*PaymentIntent, error) { return scanPI(r) })
	if err != nil {
		return Page{}, fmt.Errorf("payments: list: %w", err)
	}
	return page(pis, limit, q.EndingBefore != ""), nil
}

// Search implements Ledger: newest first by the time each row was
// written, the id breaking ties, by key set. The metadata clause is a
// jsonb containment (@>), which the GIN index payment_intents_metadata
// serves for any key.
func (l *PGLedger) Search(ctx context.Context, q SearchQuery) (Page, error) {
	limit := q.limit()
	md, err := json.Marshal(map[string]string{q.MetadataKey: q.MetadataValue})
	if err != nil {
		return Page{}, fmt.Errorf("payments: search: %w", err)
	}
	// $1 account, $2 the metadata entry, $3 status or '' for any.
	where := `account = $1 AND metadata @> $2::jsonb AND ($3 = '' OR status = $3)`
	var rows pgx.Rows
	if q.StartingAfter != "" {
		var at time.Time
		if at, err = l.cursor(ctx, q.Account, q.StartingAfter); err != nil {
			return Page{}, err
		}
		rows, err = l.pool.Query(ctx, `SELECT `+piColumns+` FROM `+l.intents+`
WHERE `+where+` AND (created_at, id) < ($4, $5)
ORDER BY created_at DESC, id DESC LIMIT $6`, q.Account, string(md), q.Status, at, q.StartingAfter, limit+1)
	} else {
		rows, err = l.pool.Query(ctx, `SELECT `+piColumns+` FROM `+l.intents+`
WHERE `+where+`
ORDER BY created_at DESC, id DESC LIMIT $4`, q.Account, string(md), q.Status, limit+1)
	}
	if err != nil {
		return Page{}, fmt.Errorf("payments: search: %w", err)
	}
	pis, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (*PaymentIntent, error) { return scanPI(r) })
	if err != nil {
		return Page{}, fmt.Errorf("payments: search: %w", err)
	}
	return page(pis, limit, false), nil
}

// cursor returns when the PaymentIntent id of account was written, or
// ErrNotFound.
func (l *PGLedger) cursor(ctx context.Context, account, id string) (time.Time, error) {
	var at time.Time
	if !storable(id) {
		return at, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	err := l.pool.QueryRow(ctx, `SELECT created_at FROM `+l.intents+` WHERE id = $1 AND account = $2`, id, account).Scan(&at)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return time.Time{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	case err != nil:
		return time.Time{}, fmt.Errorf("payments: list: %w", err)
	}
	return at, nil
}

// Count implements Counter.
func (l *PGLedger) Count(ctx context.Context, account string) (int, error) {
	var n int
	err := l.pool.QueryRow(ctx, `SELECT count(*) FROM `+l.intents+` WHERE account = $1 AND status = $2`, account, StatusSucceeded).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("payments: count: %w", err)
	}
	return n, nil
}

// CreateRefund implements Ledger: in the request's pgstore transaction
// (else in one of its own) it locks the PaymentIntent's row (FOR UPDATE),
// checks the refund against it, adds to its amount_refunded and writes
// the refund, so that concurrent refunds of one PaymentIntent take turns.
// Like a real gateway the write does not heed the cancellation of ctx.
func (l *PGLedger) CreateRefund(ctx context.Context, r *RefundRecord) error {
	ctx2 := context.WithoutCancel(ctx)
	itx, err := idem.TxFromContext(ctx)
	switch {
	case errors.Is(err, idem.ErrNoTx):
		return pgx.BeginFunc(ctx2, l.pool, func(tx pgx.Tx) error { return l.refund(ctx2, tx, r) })
	case err != nil:
		return fmt.Errorf("payments: joining the idempotent transaction: %w", err)
	}
	if _, ok := idemdriver.UnwrapTx(itx).(*pgstore.Tx); !ok {
		return fmt.Errorf("%w: the PostgreSQL ledger needs a pgstore transaction, not %T", ErrForeignTx, idemdriver.UnwrapTx(itx))
	}
	tx, err := pgstore.FromContext(ctx)
	if err != nil {
		return fmt.Errorf("payments: joining the idempotent transaction: %w", err)
	}
	return l.refund(ctx2, tx, r)
}

// refund is CreateRefund in tx.
func (l *PGLedger) refund(ctx context.Context, tx pgx.Tx, r *RefundRecord) error {
	var (
		status, currency   string
		received, refunded int64
	)
	if !storable(r.PaymentIntent) {
		return fmt.Errorf("%w: %q", ErrNotFound, r.PaymentIntent)
	}
	err := tx.QueryRow(ctx, `SELECT status, currency, amount_received, amount_refunded FROM `+l.intents+`
WHERE id = $1 AND account = $2 FOR UPDATE`, r.PaymentIntent, r.Account).Scan(&status, &currency, &received, &refunded)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("%w: %s", ErrNotFound, r.PaymentIntent)
	case err != nil:
		return fmt.Errorf("payments: refunding %s: %w", r.PaymentIntent, err)
	}
	if err := refundAmount(r, status, received, refunded); err != nil {
		return err
	}
	r.Currency = currency
	args, err := refundValues(r)
	if err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `UPDATE `+l.intents+` SET amount_refunded = amount_refunded + $1 WHERE id = $2`, r.Amount, r.PaymentIntent); err != nil {
		return fmt.Errorf("payments: refunding %s: %w", r.PaymentIntent, err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+l.refunds+` (`+refundColumns+`) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`, args...); err != nil {
		return fmt.Errorf("payments: recording %s: %w", r.ID, err)
	}
	return nil
}

// ListRefunds implements Ledger: newest first by the time each row was
// written, the id breaking ties, by key set.
func (l *PGLedger) ListRefunds(ctx context.Context, q RefundQuery) (RefundPage, error) {
	limit := q.limit()
	// $1 account, $2 payment intent or '' for all.
	where := `account = $1 AND ($2 = '' OR payment_intent = $2)`
	var (
		rows pgx.Rows
		at   time.Time
		err  error
	)
	switch {
	case q.EndingBefore != "":
		if at, err = l.refundCursor(ctx, q.Account, q.EndingBefore); err != nil {
			return RefundPage{}, err
		}
		rows, err = l.pool.Query(ctx, `SELECT `+refundColumns+` FROM `+l.refunds+`
WHERE `+where+` AND (created_at, id) > ($3, $4)
ORDER BY created_at, id LIMIT $5`, q.Account, q.PaymentIntent, at, q.EndingBefore, limit+1)
	case q.StartingAfter != "":
		if at, err = l.refundCursor(ctx, q.Account, q.StartingAfter); err != nil {
			return RefundPage{}, err
		}
		rows, err = l.pool.Query(ctx, `SELECT `+refundColumns+` FROM `+l.refunds+`
WHERE `+where+` AND (created_at, id) < ($3, $4)
ORDER BY created_at DESC, id DESC LIMIT $5`, q.Account, q.PaymentIntent, at, q.StartingAfter, limit+1)
	default:
		rows, err = l.pool.Query(ctx, `SELECT `+refundColumns+` FROM `+l.refunds+`
WHERE `+where+`
ORDER BY created_at DESC, id DESC LIMIT $3`, q.Account, q.PaymentIntent, limit+1)
	}
	if err != nil {
		return RefundPage{}, fmt.Errorf("payments: list refunds: %w", err)
	}
	rs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (*RefundRecord, error) { return scanRefund(r) })
	if err != nil {
		return RefundPage{}, fmt.Errorf("payments: list refunds: %w", err)
	}
	return refundPage(rs, limit, q.EndingBefore != ""), nil
}

// refundCursor returns when the refund id of account was written, or
// ErrNotFound.
func (l *PGLedger) refundCursor(ctx context.Context, account, id string) (time.Time, error) {
	var at time.Time
	if !storable(id) {
		return at, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	err := l.pool.QueryRow(ctx, `SELECT created_at FROM `+l.refunds+` WHERE id = $1 AND account = $2`, id, account).Scan(&at)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return time.Time{}, fmt.Errorf("%w: %s", ErrNotFound, id)
	case err != nil:
		return time.Time{}, fmt.Errorf("payments: list refunds: %w", err)
	}
	return at, nil
}
