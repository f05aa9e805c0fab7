// Package benchkit is what the performance measurements share: the
// "library alone" target of issue 11 (an http.Handler that INSERTs one row
// and answers 201 with about 200 bytes of JSON, on a given store, with or
// without idem.Middleware in front), and the request sequences of the
// load modes (see Workload).
//
// A Target owns what it writes to: a PostgreSQL schema of its own (dropped
// by Close), a SQLite file in a temporary directory of its own (removed by
// Close), a Redis key prefix of its own (its keys deleted by Close; never
// FLUSHDB).
package benchkit

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/redisfront"
	"github.com/idem-go/idem/sqlitestore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// The store kinds a Target can be built on.
const (
	Memory   = "memory"   // memstore; the bare handler writes to a map
	SQLite   = "sqlite"   // sqlitestore on a file of the Target's own
	Postgres = "postgres" // pgstore on a schema of the Target's own
	Redis    = "redis"    // redisfront in front of pgstore; the bare handler is Postgres's
)

// Stores lists the store kinds in the order the tools report them.
var Stores = []string{Memory, SQLite, Postgres, Redis}

// UserHeader names the request header that carries the user (the scope of
// an idempotency key) to the library target: the middleware's Options.User
// reads it. Workload requests set it.
const UserHeader = "X-Bench-User"

// Path is the path the Target's handler is meant to be mounted at; the
// handler itself answers every path.
const Path = "/v1/orders"

// Config says which Target to build.
type Config struct {
	// Store is one of Memory, SQLite, Postgres, Redis.
	Store string
	// Middleware puts idem.Middleware (OptionalKey: requests without a key
	// pass through unprotected) in front of the handler.
	Middleware bool
	// DatabaseURL is the PostgreSQL server (Postgres and Redis). The Target
	// creates a schema of its own there and drops it on Close.
	DatabaseURL string
	// RedisURL is the Redis server (Redis), redis://host:port[/db].
	RedisURL string
	// MaxConns is the PostgreSQL pool's size. Default 16.
	MaxConns int32
	// Dir is where the SQLite temporary directory is made. Default os.TempDir().
	Dir string
	// Logger receives the middleware's and redisfront's logs. Default: discarded.
	Logger *slog.Logger
}

// Target is the library-alone target: Handler serves the one-INSERT
// handler, behind the middleware or not. Close it when done.
type Target struct {
	Store      string
	Middleware bool

	handler http.Handler
	pool    *pgxpool.Pool   // Postgres and Redis: the pool on the Target's schema
	mem     *memstore.Store // Memory: the store
	gate    atomic.Pointer[Gate]
	ins     func(ctx context.Context, id, user string) error
	count   func(ctx context.Context) (int64, error)
	closers []func() error // run in reverse order
}

// Handler returns the target's handler: POST with a JSON body, optional
// Idempotency-Key and UserHeader; it answers 201 with an application/json
// body of about 200 bytes after inserting one row.
func (t *Target) Handler() http.Handler { return t.handler }

// Rows returns how many rows the handler has inserted (and committed).
func (t *Target) Rows(ctx context.Context) (int64, error) { return t.count(ctx) }

// CloseIdle closes the Target's idle PostgreSQL connections (the ones in
// use close when released); the pool opens new ones when next needed. A
// tool that keeps several Targets open but loads one at a time calls it
// after each load, so that together they hold no more connections than
// one does.
func (t *Target) CloseIdle() {
	if t.pool != nil {
		t.pool.Reset()
	}
}

// Close releases everything the Target made: pools, clients, the schema,
// the file, the Redis keys under its prefix. It returns the first error.
func (t *Target) Close() error {
	if g := t.gate.Load(); g != nil {
		g.Release()
	}
	var first error
	for i := len(t.closers) - 1; i >= 0; i-- {
		if err := t.closers[i](); err != nil && first == nil {
			first = err
		}
	}
	t.closers = nil
	return first
}

// New builds the Target that cfg describes. On error nothing is left behind.
func New(ctx context.Context, cfg Config) (_ *Target, err error) {
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = 16
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	t := &Target{Store: cfg.Store, Middleware: cfg.Middleware}
	defer func() {
		if err != nil {
			t.Close()
		}
	}()
	var store idem.Store
	switch cfg.Store {
	case Memory:
		store, err = t.setupMemory()
	case SQLite:
		store, err = t.setupSQLite(ctx, cfg)
	case Postgres, Redis:
		store, err = t.setupPostgres(ctx, cfg)
	default:
		return nil, fmt.Errorf("benchkit: unknown store %q (want one of %s)", cfg.Store, strings.Join(Stores, ", "))
	}
	if err != nil {
		return nil, err
	}
	var h http.Handler = http.HandlerFunc(t.serve)
	if cfg.Middleware {
		h = idem.Middleware(store, idem.Options{
			OptionalKey: true,
			User:        func(r *http.Request) string { return r.Header.Get(UserHeader) },
			Logger:      cfg.Logger,
		})(h)
	}
	t.handler = h
	return t, nil
}

func (t *Target) setupMemory() (idem.Store, error) {
	var mu sync.Mutex
	rows := map[string]string{}
	add := func(id, user string) {
		mu.Lock()
		rows[id] = user
		mu.Unlock()
	}
	t.ins = func(ctx context.Context, id, user string) error {
		tx, err := memstore.FromContext(ctx)
		switch {
		case err == nil:
			tx.OnCommit(func() { add(id, user) })
			return nil
		case errors.Is(err, idem.ErrNoTx):
			add(id, user)
			return nil
		}
		return err
	}
	t.count = func(context.Context) (int64, error) {
		mu.Lock()
		defer mu.Unlock()
		return int64(len(rows)), nil
	}
	t.mem = memstore.New(memstore.Options{})
	return t.mem, nil
}

const sqliteTable = `CREATE TABLE bench_orders (
	id TEXT PRIMARY KEY,
	user_id TEXT NOT NULL,
	amount INTEGER NOT NULL,
	created_at INTEGER NOT NULL
)`

const sqliteInsert = `INSERT INTO bench_orders (id, user_id, amount, created_at) VALUES (?, ?, 1299, ?)`

func (t *Target) setupSQLite(ctx context.Context, cfg Config) (idem.Store, error) {
	dir, err := os.MkdirTemp(cfg.Dir, "benchkit-sqlite-")
	if err != nil {
		return nil, fmt.Errorf("benchkit: %w", err)
	}
	t.closers = append(t.closers, func() error { return os.RemoveAll(dir) })
	s, err := sqlitestore.Open(ctx, filepath.Join(dir, "bench.db"), sqlitestore.Options{})
	if err != nil {
		return nil, err
	}
	t.closers = append(t.closers, s.Close)
	db := s.DB()
	if _, err := db.ExecContext(ctx, sqliteTable); err != nil {
		return nil, fmt.Errorf("benchkit: creating the table: %w", err)
	}
	// SQLite has one writer at a time. The store queues its own writers
	// in the process; the bare handler's autocommit INSERTs are queued the
	// same way here, rather than left to SQLite's busy handler, which
	// polls with sleeps and would make the bare handler look slow.
	var writing sync.Mutex
	t.ins = func(ctx context.Context, id, user string) error {
		now := time.Now().UnixNano()
		tx, err := sqlitestore.FromContext(ctx)
		switch {
		case err == nil:
			_, err = tx.ExecContext(ctx, sqliteInsert, id, user, now)
			return err
		case errors.Is(err, idem.ErrNoTx):
			writing.Lock()
			defer writing.Unlock()
			_, err = db.ExecContext(ctx, sqliteInsert, id, user, now)
			return err
		}
		return err
	}
	t.count = func(ctx context.Context) (int64, error) {
		var n int64
		err := db.QueryRowContext(ctx, `SELECT count(*) FROM bench_orders`).Scan(&n)
		return n, err
	}
	return s, nil
}

const pgTable = `CREATE TABLE bench_orders (
	id text PRIMARY KEY,
	user_id text NOT NULL,
	amount bigint NOT NULL,
	created_at timestamptz NOT NULL DEFAULT now()
)`

const pgInsert = `INSERT INTO bench_orders (id, user_id, amount) VALUES ($1, $2, 1299)`

func (t *Target) setupPostgres(ctx context.Context, cfg Config) (idem.Store, error) {
	if cfg.DatabaseURL == "" {
		return nil, fmt.Errorf("benchkit: store %s needs a DatabaseURL", cfg.Store)
	}
	if cfg.Store == Redis && cfg.RedisURL == "" {
		return nil, errors.New("benchkit: store redis needs a RedisURL")
	}
	pcfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("benchkit: database URL: %w", err)
	}
	schema := "bench_" + randomHex(8)
	if err := pgExec(ctx, cfg.DatabaseURL, "CREATE SCHEMA "+schema); err != nil {
		return nil, fmt.Errorf("benchkit: creating schema %s: %w", schema, err)
	}
	t.closers = append(t.closers, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return pgExec(ctx, cfg.DatabaseURL, "DROP SCHEMA IF EXISTS "+schema+" CASCADE")
	})
	pcfg.ConnConfig.RuntimeParams["search_path"] = schema
	pcfg.MaxConns = cfg.MaxConns
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("benchkit: %w", err)
	}
	t.closers = append(t.closers, func() error { pool.Close(); return nil })
	t.pool = pool
	if err := pgstore.Migrate(ctx, pool); err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, pgTable); err != nil {
		return nil, fmt.Errorf("benchkit: creating the table: %w", err)
	}
	t.ins = func(ctx context.Context, id, user string) error {
		tx, err := pgstore.FromContext(ctx)
		switch {
		case err == nil:
			_, err = tx.Exec(ctx, pgInsert, id, user)
			return err
		case errors.Is(err, idem.ErrNoTx):
			_, err = pool.Exec(ctx, pgInsert, id, user)
			return err
		}
		return err
	}
	t.count = func(ctx context.Context) (int64, error) {
		var n int64
		err := pool.QueryRow(ctx, `SELECT count(*) FROM bench_orders`).Scan(&n)
		return n, err
	}
	var store idem.Store = pgstore.New(pool, pgstore.Options{})
	if cfg.Store != Redis {
		return store, nil
	}
	ropts, err := redis.ParseURL(cfg.RedisURL)
	if err != nil {
		return nil, fmt.Errorf("benchkit: Redis URL: %w", err)
	}
	ropts.ContextTimeoutEnabled = true
	ropts.PoolSize = int(cfg.MaxConns) * 2
	rdb := redis.NewClient(ropts)
	prefix := "bench:" + randomHex(8) + ":"
	t.closers = append(t.closers, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err := deletePrefix(ctx, rdb, prefix)
		if cerr := rdb.Close(); err == nil {
			err = cerr
		}
		return err
	})
	if err := rdb.Ping(ctx).Err(); err != nil {
		return nil, fmt.Errorf("benchkit: Redis at %s: %w", cfg.RedisURL, err)
	}
	return redisfront.New(rdb, store, redisfront.Options{KeyPrefix: prefix, Logger: cfg.Logger}), nil
}

// deletePrefix deletes the keys under prefix, a batch at a time.
func deletePrefix(ctx context.Context, rdb *redis.Client, prefix string) error {
	iter := rdb.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	batch := make([]string, 0, 500)
	for iter.Next(ctx) {
		batch = append(batch, iter.Val())
		if len(batch) == cap(batch) {
			if err := rdb.Unlink(ctx, batch...).Err(); err != nil {
				return err
			}
			batch = batch[:0]
		}
	}
	if err := iter.Err(); err != nil {
		return err
	}
	if len(batch) > 0 {
		return rdb.Unlink(ctx, batch...).Err()
	}
	return nil
}

func pgExec(ctx context.Context, url, stmt string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, stmt)
	return err
}

// serve is the one-INSERT handler: it reads the body, waits while a Gate
// holds it (HoldHeader), inserts one row (in the request's transaction
// when there is one) and answers 201.
func (t *Target) serve(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		http.Error(w, "POST only", http.StatusMethodNotAllowed)
		return
	}
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	t.hold(r)
	id := "ord_" + randomHex(12)
	user := r.Header.Get(UserHeader)
	if err := t.ins(r.Context(), id, user); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	body := responseBody(id, user)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusCreated)
	w.Write(body)
}

// responseBody renders the created order: about 200 bytes of JSON.
func responseBody(id, user string) []byte {
	b := make([]byte, 0, 256)
	b = append(b, `{"id":"`...)
	b = append(b, id...)
	b = append(b, `","object":"order","user":`...)
	b = strconv.AppendQuote(b, user)
	b = append(b, `,"amount":1299,"currency":"EUR","status":"created","created":`...)
	b = strconv.AppendInt(b, time.Now().Unix(), 10)
	b = append(b, `,"description":"one row inserted by the benchmark handler"}`...)
	return b
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}
