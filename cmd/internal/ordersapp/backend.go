package ordersapp

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"math"
	neturl "net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/cmd/internal/pgconfig"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/outbox/pgoutbox"
	"github.com/idem-go/idem/outbox/sqliteoutbox"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/sqlitestore"
)

// backend is the storage the service runs on: the idempotency store and the
// order repository share one database, so an order and its stored response
// commit in one transaction. The in-process gateway keeps its own keys and
// ledger in the same database (its own file or schema), so that they
// survive a restart and the audit can read them.
type backend struct {
	// notes are warnings about the database's setup, logged at start.
	notes   []string
	name    string // for logs: "sqlite:/path" or "postgres"
	store   idemdriver.SweepingStore
	sweeper idemdriver.Sweeper
	// cleanDirect, when set, is the database's store itself, which the
	// cleaner sweeps instead of sweeper: the wrappers in front of it would
	// hide its faster idemdriver.ExpiredCleaner (pgstore's, whose batches each
	// start where the last one ended).
	cleanDirect idemdriver.Sweeper
	repo        orders.Repository
	allOrders   func(ctx context.Context, fn func(orders.Order) error) error
	// outbox is the table the order's event is written to with the order
	// (Repository.Create), which the relay publishes from.
	outbox outbox.Table
	// receipts writes the receipts consumer's receipts (the repository).
	receipts orders.ReceiptWriter
	// backfill gives every order without its orders.created event (made
	// before events) its event (backfillEvents).
	backfill func(ctx context.Context, batch int, progress func(added int)) (int, error)
	// allReceipts reads every receipt, for the audit.
	allReceipts func(ctx context.Context, fn func(orders.Receipt) error) error
	// The audit's readers. ordersByID reads the orders whose operation
	// began at or after since, by id; receiptsSince the receipts created at
	// or after since; keysSince the idempotency keys created at or after
	// since and every key without an outcome; each reads everything when
	// since is zero. orderExists looks one order up.
	ordersByID    func(ctx context.Context, since time.Time, fn func(orders.Order) error) error
	receiptsSince func(ctx context.Context, since time.Time, fn func(orders.Receipt) error) error
	keysSince     func(ctx context.Context, since time.Time, fn func(keyRow) error) error
	orderExists   func(ctx context.Context, id string) (bool, error)
	// gateway opens the in-process gateway's store and ledger, creating
	// them when they do not exist yet.
	gateway func(ctx context.Context) (idem.Store, payments.Ledger, error)
	// gatewayExists reports whether the in-process gateway's ledger
	// exists (some instance paid, or could have paid, through it),
	// without creating it.
	gatewayExists func(ctx context.Context) (bool, error)
	// deployment names this database among every other one, copies of it
	// included: the random id of its table deployment, mixed with where
	// the database lives (see deploymentTag).
	deployment func(ctx context.Context) (string, error)
	// now is the database's clock (SQLite's is the machine's), by which
	// the store decides leases, for the audit to judge them by.
	now func(ctx context.Context) (time.Time, error)
	// streamOf reads the stream of the order events the database records
	// (found false when it records none); putStream records one: when it
	// records none yet, or whatever it records when replace is set.
	streamOf  func(ctx context.Context) (rec streamRecord, found bool, err error)
	putStream func(ctx context.Context, created, nats string, replace bool) error
	// pg is the PostgreSQL pool, which keeps the JWT secret of instances
	// without --jwt-secret (Config.sharedSecret); nil on SQLite.
	pg      *pgxpool.Pool
	closers []func()
}

func (b *backend) close() error {
	for i := len(b.closers) - 1; i >= 0; i-- {
		b.closers[i]()
	}
	return nil
}

// openBackend opens the database that c names and migrates it.
func openBackend(ctx context.Context, c *Config) (*backend, error) {
	return openDatabase(ctx, c, true)
}

// openExisting opens the database that c names, which must exist and
// have this binary's schema: it creates and migrates nothing, neither the
// orders' tables nor the in-process gateway's. A database without the
// schema, or with an older one, is an error that says to run `orders
// migrate`; an embedded SQLite file that does not exist is one that names
// --data-dir. It is for the commands that only read (audit, keys list and
// show) or change rows of an existing schema (gc, keys redrive and purge).
// Its gateway is the one in the database, unchanged, or, when the
// in-process gateway was never set up there, an empty one in memory: it
// knows of no payment, as the one created would.
func openExisting(ctx context.Context, c *Config) (*backend, error) {
	return openDatabase(ctx, c, false)
}

func openDatabase(ctx context.Context, c *Config, migrate bool) (*backend, error) {
	if err := c.checkStorage(); err != nil {
		return nil, err
	}
	if path, ok := c.sqlitePath(); ok {
		return openSQLite(ctx, path, migrate)
	}
	u := c.DatabaseURL
	switch {
	case strings.HasPrefix(u, "postgres://"), strings.HasPrefix(u, "postgresql://"):
		return openPostgresDB(ctx, u, c.KeyLease, migrate)
	default:
		return nil, cli.Usagef("--database-url %q: want empty (embedded SQLite), sqlite:PATH or postgres://…", redactURL(u))
	}
}

// sqlitePublishTimeout bounds one relay pass's publishing on SQLite,
// during which it holds the database's write lock (sqliteoutbox.Table.Take).
const sqlitePublishTimeout = 2 * time.Second

// openSQLite opens the SQLite database at path: creating and migrating
// it with migrate, else only an existing file whose schema is current
// (openExisting).
func openSQLite(ctx context.Context, path string, migrate bool) (*backend, error) {
	if path == "" {
		return nil, cli.Usagef("--database-url: empty SQLite path")
	}
	var st *sqlitestore.Store
	if migrate {
		if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return nil, fmt.Errorf("creating the data dir: %w", err)
		}
		var err error
		if st, err = sqlitestore.Open(ctx, path, sqlitestore.Options{}); err != nil {
			return nil, fmt.Errorf("opening %s: %w", path, err)
		}
		// The outbox's table, then the orders'.
		if err := orders.MigrateSQLite(ctx, st.DB()); err != nil {
			st.Close()
			return nil, fmt.Errorf("migrating %s: %w", path, err)
		}
	} else {
		var err error
		st, err = sqlitestore.OpenExisting(ctx, path, sqlitestore.Options{})
		if errors.Is(err, sqlitestore.ErrNoDatabase) {
			return nil, fmt.Errorf("no database at %s: check --data-dir (or --database-url); this command does not create one (`orders migrate` or `orders serve` does)", quoteIfNeeded(path))
		}
		if err != nil {
			return nil, fmt.Errorf("opening %s: %w", path, err)
		}
		err = checkSchema(ctx, "sqlite:"+path, orders.SQLiteMigrations,
			func(ctx context.Context) ([]string, error) { return sqlitestore.Pending(ctx, st.DB()) },
			func(ctx context.Context) (orders.Pending, error) { return orders.PendingSQLite(ctx, st.DB()) })
		if err != nil {
			st.Close()
			return nil, err
		}
	}
	events := sqliteoutbox.New(st.DB())
	// Take holds SQLite's write lock while it publishes: bound how long
	// the orders being written may wait for it when NATS is slow.
	events.PublishTimeout = sqlitePublishTimeout
	repo := orders.NewSQLiteRepository(st.DB(), sqlitestore.FromContext)
	b := &backend{
		name:          "sqlite:" + path,
		store:         st,
		sweeper:       st,
		repo:          repo,
		allOrders:     repo.AllOrders,
		outbox:        events,
		receipts:      repo,
		backfill:      repo.BackfillEvents,
		allReceipts:   repo.AllReceipts,
		ordersByID:    repo.OrdersByID,
		receiptsSince: repo.ReceiptsSince,
		orderExists:   repo.OrderExists,
		keysSince: func(ctx context.Context, since time.Time, fn func(keyRow) error) error {
			return sqliteKeys(ctx, st.DB(), since, fn)
		},
		now: func(context.Context) (time.Time, error) { return time.Now(), nil },
		deployment: func(ctx context.Context) (string, error) {
			// A copied file keeps the row: the file's place tells the copies apart.
			var id string
			if err := st.DB().QueryRowContext(ctx, `SELECT id FROM deployment`).Scan(&id); err != nil {
				return "", err
			}
			abs, err := filepath.Abs(path)
			if err != nil {
				return "", err
			}
			host, _ := os.Hostname()
			return deploymentTag(id, host, abs), nil
		},
		streamOf: func(ctx context.Context) (streamRecord, bool, error) {
			var r streamRecord
			var at string
			err := st.DB().QueryRowContext(ctx, `SELECT created, nats, registered_at FROM event_stream`).Scan(&r.created, &r.nats, &at)
			if errors.Is(err, sql.ErrNoRows) {
				return r, false, nil
			}
			if err != nil {
				return r, false, err
			}
			r.at, err = time.Parse(time.RFC3339Nano, at)
			return r, true, err
		},
		putStream: func(ctx context.Context, created, nats string, replace bool) error {
			q := `INSERT INTO event_stream (singleton, created, nats) VALUES (1, ?, ?) ON CONFLICT (singleton) DO NOTHING`
			if replace {
				q = `INSERT INTO event_stream (singleton, created, nats) VALUES (1, ?, ?) ON CONFLICT (singleton) DO UPDATE
SET created = excluded.created, nats = excluded.nats, registered_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now')`
			}
			_, err := st.DB().ExecContext(ctx, q, created, nats)
			return err
		},
		closers: []func(){func() { st.Close() }},
	}
	// The gateway's file sits beside the order database.
	gwPath := strings.TrimSuffix(path, filepath.Ext(path)) + "-payments.db"
	b.gatewayExists = func(ctx context.Context) (bool, error) {
		switch _, err := os.Stat(gwPath); {
		case err == nil:
			return true, nil
		case errors.Is(err, fs.ErrNotExist):
			return false, nil
		default:
			return false, err
		}
	}
	b.gateway = func(ctx context.Context) (idem.Store, payments.Ledger, error) {
		gst, ledger, err := payments.OpenSQLite(ctx, gwPath)
		if err != nil {
			return nil, nil, fmt.Errorf("opening the gateway's %s: %w", gwPath, err)
		}
		b.closers = append(b.closers, func() { gst.Close() })
		return gst, ledger, nil
	}
	if !migrate {
		b.gateway = existingGateway(b.gatewayExists, func(ctx context.Context) (idem.Store, payments.Ledger, error) {
			gst, ledger, err := payments.OpenExistingSQLite(ctx, gwPath)
			if err != nil {
				return nil, nil, gatewaySchemaError("its database "+gwPath, err)
			}
			b.closers = append(b.closers, func() { gst.Close() })
			return gst, ledger, nil
		})
	}
	return b, nil
}

// sqliteKeys calls fn with every idempotency key created at or after since
// (every key when since is zero) and every key without an outcome, in no
// particular order, from one query.
func sqliteKeys(ctx context.Context, db *sql.DB, since time.Time, fn func(keyRow) error) error {
	var from int64 = math.MinInt64
	if !since.IsZero() {
		from = since.UnixNano()
	}
	rows, err := db.QueryContext(ctx, `SELECT user_id, key, method, created_at, COALESCE(response_status, 0), lease_until, expires_at, attempts, redrives
		FROM idempotency_keys WHERE created_at >= ? OR response_status IS NULL`, from)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var k keyRow
		var created, lease, expires int64
		if err := rows.Scan(&k.User, &k.Key, &k.Method, &created, &k.Status, &lease, &expires, &k.Attempts, &k.Redrives); err != nil {
			return err
		}
		k.CreatedAt, k.LeaseUntil, k.ExpiresAt = time.Unix(0, created).UTC(), time.Unix(0, lease).UTC(), time.Unix(0, expires).UTC()
		if err := fn(k); err != nil {
			return err
		}
	}
	return rows.Err()
}

// idleTxTimeoutParam is the PostgreSQL setting that openPostgres sets to
// the key lease.
const idleTxTimeoutParam = "idle_in_transaction_session_timeout"

// pgPoolSize is the pool size of an instance unless the URL sets
// pool_max_conns: requests hold a connection only to claim and to commit.
const pgPoolSize = 16

// openPostgres opens the pool and migrates. Its sessions end a transaction
// left idle longer than the key lease (idle_in_transaction_session_timeout,
// unless the URL sets it): an instance cut off from the database in the
// middle of a request's transaction would otherwise keep that transaction,
// and its row locks on the order and on the key, for as long as the server
// keeps the connection (hours), and every retry and the completer would
// wait on them long after the lease gave the key to another attempt. The
// order handler opens its transaction after the payment, so a transaction
// of its own is idle only for round trips; an attempt whose transaction is
// ended this way answers 503 and its retry continues the operation with the
// same payment key; its one slow call inside a transaction, the refund of
// an order the database refused, keeps the transaction for the payment
// timeout (orders.TxKeeper). The value is in milliseconds, at least 1 s.
// Behind pgbouncer, add the parameter to ignore_startup_parameters (and
// set the timeout on the server) or it refuses the connection.
func openPostgres(ctx context.Context, url string, lease time.Duration) (*backend, error) {
	return openPostgresDB(ctx, url, lease, true)
}

// openPostgresDB is openPostgres; without migrate, it migrates nothing and
// refuses a database whose schema is missing or older than this binary's
// (openExisting).
func openPostgresDB(ctx context.Context, url string, lease time.Duration, migrate bool) (*backend, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, cli.Usagef("--database-url: %v", err)
	}
	// Set by the URL (or PGOPTIONS) as a parameter of its own or in
	// options (-c name=value, --name=value): the user's value is kept,
	// since a startup parameter would silently override options.
	_, set := cfg.ConnConfig.RuntimeParams[idleTxTimeoutParam]
	if !set && strings.Contains(strings.ReplaceAll(cfg.ConnConfig.RuntimeParams["options"], "-", "_"), idleTxTimeoutParam) {
		set = true
	}
	if !set {
		cfg.ConnConfig.RuntimeParams[idleTxTimeoutParam] = strconv.FormatInt(max(lease, time.Second).Milliseconds(), 10)
	}
	if u, err := neturl.Parse(url); err != nil || !u.Query().Has("pool_max_conns") {
		cfg.MaxConns = pgPoolSize
	}
	pgconfig.Apply(cfg, url)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connecting to PostgreSQL: %w", err)
	}
	var notes []string
	if err := pool.Ping(ctx); err != nil {
		// PgBouncer refuses a startup parameter it does not track: the
		// timeout then cannot be set per session, and the pooler's
		// idle_transaction_timeout or the server's setting must do it.
		name, refused := pgconfig.UnsupportedStartupParameter(err)
		if !refused || name != idleTxTimeoutParam || set {
			pool.Close()
			return nil, fmt.Errorf("connecting to PostgreSQL: %w", err)
		}
		pool.Close()
		delete(cfg.ConnConfig.RuntimeParams, idleTxTimeoutParam)
		if pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
			return nil, fmt.Errorf("connecting to PostgreSQL: %w", err)
		}
		notes = append(notes, fmt.Sprintf("the server or pooler at the database URL refuses %s as a startup parameter (PgBouncer does): "+
			"a request's transaction cut off from this instance is ended only by PgBouncer's idle_transaction_timeout or the server's own setting "+
			"(ALTER DATABASE … SET %s = '%s'); set one of them to the key lease", idleTxTimeoutParam, idleTxTimeoutParam, max(lease, time.Second)))
	}
	if migrate {
		if err := pgstore.Migrate(ctx, pool); err != nil {
			pool.Close()
			return nil, fmt.Errorf("migrating: %w", err)
		}
		// The outbox's table, then the orders'.
		if err := orders.MigratePostgres(ctx, pool); err != nil {
			pool.Close()
			return nil, fmt.Errorf("migrating orders: %w", err)
		}
	} else {
		err := checkSchema(ctx, "postgres:"+cfg.ConnConfig.Host+"/"+cfg.ConnConfig.Database, orders.PostgresMigrations,
			func(ctx context.Context) ([]string, error) { return pgstore.Pending(ctx, pool) },
			func(ctx context.Context) (orders.Pending, error) { return orders.PendingPostgres(ctx, pool) })
		if err != nil {
			pool.Close()
			return nil, err
		}
	}
	events := pgoutbox.New(pool)
	// A mode named in the URL is the store's too: cache_statement is the
	// opt-in for named prepared statements on a direct connection.
	st := pgstore.New(pool, pgstore.Options{QueryExecMode: pgconfig.StoreMode(cfg, url)})
	repo := orders.NewPostgresRepository(pool, pgstore.FromContext)
	b := &backend{
		notes:         notes,
		pg:            pool,
		name:          "postgres:" + cfg.ConnConfig.Host + "/" + cfg.ConnConfig.Database,
		store:         st,
		sweeper:       st,
		cleanDirect:   st,
		repo:          repo,
		allOrders:     repo.AllOrders,
		outbox:        events,
		receipts:      repo,
		backfill:      repo.BackfillEvents,
		allReceipts:   repo.AllReceipts,
		ordersByID:    repo.OrdersByID,
		receiptsSince: repo.ReceiptsSince,
		orderExists:   repo.OrderExists,
		keysSince: func(ctx context.Context, since time.Time, fn func(keyRow) error) error {
			return pgKeys(ctx, pool, since, fn)
		},
		now: func(ctx context.Context) (time.Time, error) {
			var t time.Time
			return t, pool.QueryRow(ctx, `SELECT statement_timestamp()`).Scan(&t)
		},
		deployment: func(ctx context.Context) (string, error) {
			// A database copied keeps the row. A logical copy (CREATE
			// DATABASE … TEMPLATE, a restored dump) differs in the cluster's
			// system identifier or the database's oid; a physical one (a
			// snapshot, pg_basebackup, a split-off replica) in neither, but
			// it is served from another address or port than the original.
			var id, sysID, oid, schema, addr string
			err := pool.QueryRow(ctx, `
SELECT d.id, (SELECT system_identifier::text FROM pg_control_system()),
	(SELECT oid::text FROM pg_database WHERE datname = current_database()), coalesce(current_schema(), ''),
	coalesce(host(inet_server_addr()), '') || ':' || coalesce(inet_server_port()::text, '')
FROM deployment d`).Scan(&id, &sysID, &oid, &schema, &addr)
			if err != nil {
				return "", err
			}
			return deploymentTag(id, sysID, oid, schema, addr), nil
		},
		streamOf: func(ctx context.Context) (streamRecord, bool, error) {
			var r streamRecord
			err := pool.QueryRow(ctx, `SELECT created, nats, registered_at FROM event_stream`).Scan(&r.created, &r.nats, &r.at)
			if errors.Is(err, pgx.ErrNoRows) {
				return r, false, nil
			}
			return r, err == nil, err
		},
		putStream: func(ctx context.Context, created, nats string, replace bool) error {
			q := `INSERT INTO event_stream (created, nats) VALUES ($1, $2) ON CONFLICT (singleton) DO NOTHING`
			if replace {
				q = `INSERT INTO event_stream (created, nats) VALUES ($1, $2) ON CONFLICT (singleton) DO UPDATE
SET created = excluded.created, nats = excluded.nats, registered_at = now()`
			}
			_, err := pool.Exec(ctx, q, created, nats)
			return err
		},
		closers: []func(){pool.Close},
	}
	// The in-process gateway's tables are in a schema of their own, which
	// its every statement names: its pool sets no search_path, which a
	// pooler in transaction mode refuses or drops. The orders' store lists
	// every record of its schema for the completer, so it must not be
	// that one.
	b.gateway = func(ctx context.Context) (idem.Store, payments.Ledger, error) {
		var schema *string // NULL when no schema of the search_path exists
		if err := pool.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
			return nil, nil, fmt.Errorf("the orders' schema: %w", err)
		}
		if schema != nil && *schema == payments.DefaultSchema {
			return nil, nil, fmt.Errorf("the orders' tables are in the schema %q (the first of the session's search_path), the in-process gateway's: "+
				"give the orders a schema of their own (search_path in --database-url), or use an external gateway (--payments-url)", payments.DefaultSchema)
		}
		gpool, err := payments.PostgresPool(ctx, url, payments.DefaultSchema)
		if err != nil {
			return nil, nil, fmt.Errorf("the gateway's schema: %w", err)
		}
		gst, ledger, err := payments.OpenPostgres(ctx, gpool, payments.DefaultSchema)
		if err != nil {
			gpool.Close()
			return nil, nil, err
		}
		b.closers = append(b.closers, gpool.Close)
		return gst, ledger, nil
	}
	b.gatewayExists = func(ctx context.Context) (bool, error) {
		var ok bool
		err := pool.QueryRow(ctx, `SELECT to_regclass(quote_ident($1) || '.payment_intents') IS NOT NULL`, payments.DefaultSchema).Scan(&ok)
		return ok, err
	}
	if !migrate {
		b.gateway = existingGateway(b.gatewayExists, func(ctx context.Context) (idem.Store, payments.Ledger, error) {
			gpool, err := payments.PostgresPool(ctx, url, payments.DefaultSchema)
			if err != nil {
				return nil, nil, fmt.Errorf("the gateway's schema: %w", err)
			}
			gst, ledger, err := payments.OpenExistingPostgres(ctx, gpool, payments.DefaultSchema)
			if err != nil {
				gpool.Close()
				return nil, nil, gatewaySchemaError("its schema "+payments.DefaultSchema, err)
			}
			b.closers = append(b.closers, gpool.Close)
			return gst, ledger, nil
		})
	}
	return b, nil
}

// pgKeys is sqliteKeys on PostgreSQL.
func pgKeys(ctx context.Context, pool *pgxpool.Pool, since time.Time, fn func(keyRow) error) error {
	rows, err := pool.Query(ctx, `SELECT user_id, key, method, created_at, COALESCE(response_status, 0), lease_until, expires_at, attempts, redrives
		FROM idempotency_keys WHERE created_at >= $1 OR response_status IS NULL`, since)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var k keyRow
		if err := rows.Scan(&k.User, &k.Key, &k.Method, &k.CreatedAt, &k.Status, &k.LeaseUntil, &k.ExpiresAt, &k.Attempts, &k.Redrives); err != nil {
			return err
		}
		if err := fn(k); err != nil {
			return err
		}
	}
	return rows.Err()
}

// deploymentTag hashes the fields that name one database into 16 hex
// characters, for the Redis key prefix.
func deploymentTag(fields ...string) string {
	h := sha256.New()
	for _, f := range fields {
		fmt.Fprintf(h, "%d:%s;", len(f), f)
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}

// cleaner returns a cleaner of the store's expired idempotency keys with
// opts. Redis in front changes nothing: its entries expire by themselves.
func (b *backend) cleaner(opts idem.CleanerOptions) *idem.Cleaner {
	if b.cleanDirect != nil {
		return idem.NewCleaner(b.cleanDirect, opts)
	}
	return idem.NewCleaner(b.sweeper, opts)
}

// backfillBatch is how many orders' keys one batch of backfillEvents
// reads (their missing events are added in one transaction).
const backfillBatch = 500

// backfillEvents gives every order without its orders.created event (one
// made before the service wrote events: an upgraded database) its event,
// in batches of backfillBatch orders, and returns how many it added;
// the relay publishes them and the consumer writes their receipts. It
// reads every order once. migrate runs it, and serve in the background.
func backfillEvents(ctx context.Context, be *backend, logger *slog.Logger) (int, error) {
	n, err := be.backfill(ctx, backfillBatch, func(total int) {
		if total > 0 && total%(20*backfillBatch) == 0 {
			logger.Info("orders: writing the orders.created events of orders made before events", "so_far", total)
		}
	})
	if n > 0 {
		logger.Info("orders: wrote the orders.created event of every order made before events", "orders", n)
	}
	return n, err
}

// errNoSchema and errOldSchema are matched (errors.Is) by openExisting's
// error for a database without the order service's schema, and for one
// whose schema is older than this binary's.
var (
	errNoSchema  = errors.New("no order service schema in this database: run `orders migrate` (or start `orders serve`) first")
	errOldSchema = errors.New("the database's schema is older than this binary: run `orders migrate` first")
)

// checkSchema returns nil when the database named has every migration of
// this binary (the store's, read by store, and the outbox's and orders',
// read by app), errNoSchema when it has none of the orders' (whose files
// are ordersFS), else errOldSchema naming the pending migrations. It
// reads only.
func checkSchema(ctx context.Context, name string, ordersFS fs.FS,
	store func(context.Context) ([]string, error), app func(context.Context) (orders.Pending, error),
) error {
	own, err := store(ctx)
	if err != nil {
		return fmt.Errorf("reading the schema's version (%s): %w", name, err)
	}
	pending, err := app(ctx)
	if err != nil {
		return fmt.Errorf("reading the schema's version (%s): %w", name, err)
	}
	if len(own) > 0 {
		pending[pgstore.Component] = own
	}
	if pending.Empty() {
		return nil
	}
	all, err := fs.Glob(ordersFS, "*.sql")
	if err != nil {
		return err
	}
	if len(pending["orders"]) >= len(all) {
		return fmt.Errorf("%w (%s); this command does not create or migrate one", errNoSchema, name)
	}
	var names []string
	for _, comp := range slices.Sorted(maps.Keys(pending)) {
		for _, n := range pending[comp] {
			names = append(names, comp+"/"+n)
		}
	}
	return fmt.Errorf("%w (%s: %s not applied); this command does not migrate", errOldSchema, name, strings.Join(names, ", "))
}

// existingGateway is openExisting's in-process gateway: open's when the
// database has one (exists), else an empty one in memory, which changes
// nothing in the database and knows of no payment.
func existingGateway(exists func(context.Context) (bool, error), open func(context.Context) (idem.Store, payments.Ledger, error)) func(context.Context) (idem.Store, payments.Ledger, error) {
	return func(ctx context.Context) (idem.Store, payments.Ledger, error) {
		ok, err := exists(ctx)
		if err != nil {
			return nil, nil, fmt.Errorf("looking for the in-process gateway's ledger: %w", err)
		}
		if !ok {
			return memstore.New(memstore.Options{}), payments.NewMemLedger(), nil
		}
		return open(ctx)
	}
}

// gatewaySchemaError explains that the in-process gateway's tables (in
// where) are older than this binary's.
func gatewaySchemaError(where string, err error) error {
	if errors.Is(err, payments.ErrSchemaNotCurrent) {
		return fmt.Errorf("the in-process gateway's tables (%s) are older than this binary: run `orders migrate` first; this command does not migrate: %w", where, err)
	}
	return fmt.Errorf("the in-process gateway (%s): %w", where, err)
}
