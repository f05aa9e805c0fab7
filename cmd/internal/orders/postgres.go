package orders

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/outbox/pgoutbox"
)

//go:embed migrations/postgres/*.sql
var postgresMigrations embed.FS

// PostgresMigrations holds the PostgreSQL schema of the orders, deployment,
// receipts and jwt_secret tables as numbered .sql files (0001_create_orders.sql, …),
// to be applied with pgstore.ApplyMigrations(ctx, pool, "orders",
// PostgresMigrations). MigratePostgres applies them, after the outbox's.
var PostgresMigrations fs.FS = mustSub(postgresMigrations, "migrations/postgres")

var (
	_ Repository = (*PostgresRepository)(nil)
	_ TxKeeper   = (*PostgresRepository)(nil)
)

// PostgresRepository is a Repository on PostgreSQL (pgx). Its semantics
// and errors are those of SQLiteRepository; times are kept to the
// microsecond, which is the precision the service writes. It writes each
// order's orders.created event (EventFor) to the outbox table of package
// outbox in the same schema; MigratePostgres creates both.
type PostgresRepository struct {
	pool   *pgxpool.Pool
	txFrom func(context.Context) (pgx.Tx, error)
	outbox *pgoutbox.Table
}

// NewPostgresRepository returns a repository on pool, whose search_path
// selects the schema that MigratePostgres created. txFrom returns the
// transaction of the idempotent request that ctx belongs to (such as
// pgstore.FromContext); when it returns an error matching idem.ErrNoTx, or
// is nil, Create writes in a transaction of its own.
func NewPostgresRepository(pool *pgxpool.Pool, txFrom func(ctx context.Context) (pgx.Tx, error)) *PostgresRepository {
	return &PostgresRepository{pool: pool, txFrom: txFrom, outbox: pgoutbox.New(pool)}
}

// KeepTx implements TxKeeper: it sets idle_in_transaction_session_timeout
// to d (at least 1 s) for the rest of the request's transaction
// (set_config with is_local).
func (r *PostgresRepository) KeepTx(ctx context.Context, d time.Duration) error {
	if r.txFrom == nil {
		return nil
	}
	tx, err := r.txFrom(ctx)
	if errors.Is(err, idem.ErrNoTx) {
		return nil
	}
	if err != nil {
		return err
	}
	ms := max(d, time.Second).Milliseconds()
	_, err = tx.Exec(ctx, `SELECT set_config('idle_in_transaction_session_timeout', $1, true)`, strconv.FormatInt(ms, 10))
	return err
}

// pgExecer is what the repository writes through: a transaction or the
// pool.
type pgExecer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Create implements Repository: it inserts o and adds its orders.created
// event (EventFor) to the outbox, both in a savepoint of the request's
// transaction when there is one, else in a transaction of their own.
func (r *PostgresRepository) Create(ctx context.Context, o *Order) error {
	tx, err := r.requestTx(ctx)
	if err != nil {
		return err
	}
	if tx != nil {
		return r.insertInSavepoint(ctx, tx, o)
	}
	tx, err = r.pool.Begin(ctx)
	if err != nil {
		return interpretPgError(err)
	}
	defer tx.Rollback(ctx)
	if err := r.insert(ctx, tx, o); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return interpretPgWriteError(err)
	}
	return nil
}

// insertInSavepoint inserts o and its event in a savepoint of tx, so that
// a refused insert leaves tx usable: PostgreSQL aborts a whole transaction
// on an error, and the request's transaction must still commit the answer
// that says the order could not be written.
func (r *PostgresRepository) insertInSavepoint(ctx context.Context, tx pgx.Tx, o *Order) error {
	sp, err := tx.Begin(ctx) // SAVEPOINT
	if err != nil {
		return fmt.Errorf("orders: savepoint: %w", err)
	}
	if err := r.insert(ctx, sp, o); err != nil {
		if rerr := sp.Rollback(ctx); rerr != nil { // ROLLBACK TO SAVEPOINT
			// The request's transaction is lost: not a refusal of the
			// order, a failure to retry.
			return fmt.Errorf("orders: rolling back to the savepoint: %w (after: %v)", rerr, err)
		}
		return err
	}
	if err := sp.Commit(ctx); err != nil { // RELEASE SAVEPOINT
		return fmt.Errorf("orders: releasing the savepoint: %w", err)
	}
	return nil
}

// insert inserts o, then adds its event, in tx.
func (r *PostgresRepository) insert(ctx context.Context, tx pgx.Tx, o *Order) error {
	if err := insertPgOrder(ctx, tx, o); err != nil {
		return err
	}
	// The event shows the order as it reads back: created_at to the
	// microsecond, as insertPgOrder writes it.
	shown := *o
	shown.CreatedAt = pgTime(o.CreatedAt)
	ev, err := EventFor(&shown)
	if err != nil {
		return err
	}
	if err := r.outbox.Add(ctx, tx, ev); err != nil {
		return eventError(o, err)
	}
	o.EventAdded = true
	return nil
}

// pgTime is t as a timestamptz keeps it: UTC, to the microsecond
// (truncated, as pgx's binary encoding does).
func pgTime(t time.Time) time.Time { return t.UTC().Truncate(time.Microsecond) }

func insertPgOrder(ctx context.Context, db pgExecer, o *Order) error {
	items, err := json.Marshal(o.Items)
	if err != nil {
		return fmt.Errorf("orders: encoding items: %w", err)
	}
	var (
		key        *string
		keyCreated *time.Time
	)
	if o.IdempotencyKey != "" {
		k, kc := o.IdempotencyKey, o.KeyCreatedAt.UTC()
		key, keyCreated = &k, &kc
	}
	_, err = db.Exec(ctx, `INSERT INTO orders
		(id, user_id, status, items, total, currency, payment_id, idempotency_key, idempotency_key_created_at, created_at, event_added)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, true)`,
		o.ID, o.UserID, o.Status, string(items), o.Total, o.Currency, o.PaymentID, key, keyCreated, pgTime(o.CreatedAt))
	if err != nil {
		return interpretPgWriteError(err)
	}
	return nil
}

// interpretPgWriteError is interpretPgError for the insert of an order: it
// also returns ErrUnwritable for the refusals that no retry changes.
func interpretPgWriteError(err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pgPermanent(pe) && !(pe.Code == "23505" && pgExistsConstraints[pe.ConstraintName]) {
		return fmt.Errorf("%w: %v", ErrUnwritable, err)
	}
	return interpretPgError(err)
}

// pgPermanent reports whether PostgreSQL refused a statement because of the
// data it writes, so that the same statement always fails: class 22 (data
// exception, such as jsonb's refusal of \u0000 or a value out of range),
// class 23 (integrity constraint violation) and 54000 (program limit
// exceeded, such as an index row over its maximum size). Connection
// failures, serialization failures, deadlocks, lock timeouts, shutdowns and
// missing tables are not: they may pass on a retry.
func pgPermanent(pe *pgconn.PgError) bool {
	return strings.HasPrefix(pe.Code, "22") || strings.HasPrefix(pe.Code, "23") || pe.Code == "54000"
}

// Constraints whose violation means the order exists already.
var pgExistsConstraints = map[string]bool{
	"orders_pkey":                    true,
	"orders_user_id_idempotency_key": true,
}

// interpretPgError translates pgx's errors into the package's.
func interpretPgError(err error) error {
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &pe) && pe.Code == "23505" && pgExistsConstraints[pe.ConstraintName]:
		return fmt.Errorf("%w: %v", ErrExists, err)
	case errors.Is(err, pgx.ErrNoRows):
		return ErrNotFound
	default:
		return fmt.Errorf("orders: %w", err)
	}
}

// pgLookupError is err, or ErrNotFound when PostgreSQL refused the id
// looked up for its bytes (class 22, data exception: NUL or bytes that are
// not UTF-8, SQLSTATE 22021): such an id names no order. The handler
// refuses such ids before the query; this is the safety net.
func pgLookupError(err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && strings.HasPrefix(pe.Code, "22") {
		return fmt.Errorf("%w: %v", ErrNotFound, err)
	}
	return err
}

func scanPgOrder(row pgx.Row) (Order, error) {
	var (
		o          Order
		items      []byte
		key        *string
		keyCreated *time.Time
		eventAdded *bool
	)
	if err := row.Scan(&o.ID, &o.UserID, &o.Status, &items, &o.Total, &o.Currency, &o.PaymentID, &key, &keyCreated, &o.CreatedAt, &eventAdded); err != nil {
		return o, interpretPgError(err)
	}
	if err := json.Unmarshal(items, &o.Items); err != nil {
		return o, fmt.Errorf("orders: order %s: items: %w", o.ID, err)
	}
	// pgx returns times in time.Local; the service shows them in UTC.
	o.CreatedAt = o.CreatedAt.UTC()
	if key != nil {
		o.IdempotencyKey = *key
	}
	if keyCreated != nil {
		o.KeyCreatedAt = keyCreated.UTC()
	}
	o.EventAdded = eventAdded != nil && *eventAdded
	return o, nil
}

// Get implements Repository.
func (r *PostgresRepository) Get(ctx context.Context, userID, id string) (*Order, error) {
	o, err := scanPgOrder(r.pool.QueryRow(ctx,
		`SELECT `+orderColumns+` FROM orders WHERE id = $1 AND user_id = $2`, id, userID))
	if err != nil {
		return nil, pgLookupError(err)
	}
	return &o, nil
}

// List implements Repository. Pages are keyset-paginated on (created_at,
// id), newest first, so they stay stable while orders are added.
func (r *PostgresRepository) List(ctx context.Context, userID string, limit int, startingAfter string) ([]Order, bool, error) {
	if limit < 1 {
		return nil, false, fmt.Errorf("orders: limit %d < 1", limit)
	}
	query := `SELECT ` + orderColumns + ` FROM orders WHERE user_id = $1`
	args := []any{userID}
	if startingAfter != "" {
		var created time.Time
		err := r.pool.QueryRow(ctx, `SELECT created_at FROM orders WHERE id = $1 AND user_id = $2`, startingAfter, userID).Scan(&created)
		if err != nil {
			return nil, false, pgLookupError(interpretPgError(err))
		}
		query += ` AND (created_at, id) < ($2, $3)`
		args = append(args, created, startingAfter)
	}
	query += fmt.Sprintf(` ORDER BY created_at DESC, id DESC LIMIT $%d`, len(args)+1)
	args = append(args, limit+1)
	out, err := r.query(ctx, query, args...)
	if err != nil {
		return nil, false, err
	}
	more := len(out) > limit
	if more {
		out = out[:limit]
	}
	return out, more, nil
}

func (r *PostgresRepository) query(ctx context.Context, query string, args ...any) ([]Order, error) {
	rows, err := r.pool.Query(ctx, query, args...)
	if err != nil {
		return nil, interpretPgError(err)
	}
	defer rows.Close()
	var out []Order
	for rows.Next() {
		o, err := scanPgOrder(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, o)
	}
	if err := rows.Err(); err != nil {
		return nil, interpretPgError(err)
	}
	return out, nil
}

// Ping implements Repository: it also checks that the orders table exists.
func (r *PostgresRepository) Ping(ctx context.Context) error {
	var one int
	err := r.pool.QueryRow(ctx, `SELECT 1 FROM orders LIMIT 1`).Scan(&one)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("orders: ping: %w", err)
	}
	return nil
}

// AllOrders calls fn with every order of every user, IdempotencyKey and
// KeyCreatedAt included, ordered by user_id, created_at and id, for audits.
// It reads in keyset pages of a bounded size and holds no connection while
// fn runs, so fn may use the database; orders created during the scan
// appear when they sort after the current position. It stops at fn's
// first error and returns it as is.
func (r *PostgresRepository) AllOrders(ctx context.Context, fn func(Order) error) error {
	page, err := r.query(ctx, `SELECT `+orderColumns+` FROM orders
		ORDER BY user_id, created_at, id LIMIT $1`, auditPageSize)
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
			WHERE (user_id, created_at, id) > ($1, $2, $3)
			ORDER BY user_id, created_at, id LIMIT $4`,
			last.UserID, last.CreatedAt, last.ID, auditPageSize)
	}
}
