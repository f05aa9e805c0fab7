// Package pgtest gives tests a PostgreSQL server to talk to: its address
// comes from TEST_DATABASE_URL; without it a test skips, except under CI=true
// where the machine's server is used and must answer. A test gets a
// database (Database) or a schema (Schema, SchemaName, Pool) of its own,
// dropped when it ends.
package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultURL is the server used under CI when TEST_DATABASE_URL is unset.
const DefaultURL = "postgres://root@127.0.0.1:5432/test"

// URL returns the server's address, or skips t.
func URL(t testing.TB) string {
	t.Helper()
	u := os.Getenv("TEST_DATABASE_URL")
	if u == "" {
		if os.Getenv("CI") != "true" {
			t.Skip("PostgreSQL tests skipped: set TEST_DATABASE_URL (e.g. " + DefaultURL + ") or CI=true")
		}
		u = DefaultURL
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := adminPing(ctx, u); err != nil {
		t.Fatalf("PostgreSQL at %s does not answer: %v", u, err)
	}
	return u
}

// Database creates an empty database for t, drops it when t ends, and
// returns its URL. Processes started by the test can use it whole.
func Database(t testing.TB) string {
	t.Helper()
	return DatabaseWith(t, "")
}

// SQLASCII is DatabaseWith's options for a database whose encoding is
// SQL_ASCII under the C locale, as initdb or pg_autoctl make it when the
// environment's locale is C: a valid setup on which a client that does
// not set client_encoding gets SQL_ASCII, not UTF8.
const SQLASCII = "ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"

// DatabaseWith is Database created with options appended to its CREATE
// DATABASE (SQLASCII, say).
func DatabaseWith(t testing.TB, options string) string {
	t.Helper()
	admin := URL(t)
	name := newName()
	if err := exec(admin, "CREATE DATABASE "+name+" "+options); err != nil {
		t.Fatalf("creating database %s: %v", name, err)
	}
	u, err := url.Parse(admin)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	dbURL := u.String()
	t.Cleanup(func() {
		forget(dbURL)
		if err := exec(admin, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Logf("dropping database %s: %v", name, err)
		}
	})
	return dbURL
}

// admins holds a small pool per server address for pgtest's own
// statements (URL's check, creating and dropping databases and schemas),
// kept for the life of the test process. On the CI machine a new
// PostgreSQL connection costs the server about 30 ms of CPU, and a test
// package makes hundreds of these statements: one connection each made
// connections a large share of the server's work in a CI run.
var admins struct {
	sync.Mutex
	pools map[string]*pgxpool.Pool
}

// admin returns the pool for the server at u.
func admin(u string) (*pgxpool.Pool, error) {
	admins.Lock()
	defer admins.Unlock()
	if p, ok := admins.pools[u]; ok {
		return p, nil
	}
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 2
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return nil, err
	}
	if admins.pools == nil {
		admins.pools = map[string]*pgxpool.Pool{}
	}
	admins.pools[u] = p
	return p, nil
}

// forget closes and drops the pool for u, a database about to be dropped
// (PoolOn's schema statements made it), so that pools do not pile up
// over a test process's databases.
func forget(u string) {
	admins.Lock()
	p, ok := admins.pools[u]
	delete(admins.pools, u)
	admins.Unlock()
	if ok {
		p.Close()
	}
}

// adminPing checks that the server at u answers.
func adminPing(ctx context.Context, u string) error {
	p, err := admin(u)
	if err != nil {
		return err
	}
	return withRetry(func() error { return p.Ping(ctx) })
}

// exec runs one statement on the server at u (its admin pool).
func exec(u, sql string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := admin(u)
	if err != nil {
		return err
	}
	return withRetry(func() error {
		_, err := p.Exec(ctx, sql)
		return err
	})
}

// withRetry runs f again, once, when its first error says that the
// statement never ran: a pooled connection that a test's own
// pg_terminate_backend (or a server restart) ended while it sat idle.
func withRetry(f func() error) error {
	err := f()
	var pgErr *pgconn.PgError
	if err != nil && (pgconn.SafeToRetry(err) || errors.As(err, &pgErr) && pgErr.Code == "57P01") {
		err = f()
	}
	return err
}

// newName returns a fresh name for a database or schema of a test's own.
func newName() string {
	var b [8]byte
	rand.Read(b[:])
	return "t_" + hex.EncodeToString(b[:])
}

// SchemaName returns the server's address and a fresh schema name for t,
// without creating the schema: for code under test that creates it. When
// t ends the schema, if it exists, is dropped with everything in it; the
// drop is registered first, so it runs after the test's other cleanups
// (closing its pools).
func SchemaName(t testing.TB) (url, schema string) {
	t.Helper()
	url = URL(t)
	schema = newName()
	t.Cleanup(func() {
		if err := exec(url, "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
			t.Errorf("dropping schema %s: %v", schema, err)
		}
	})
	return url, schema
}

// Schema is SchemaName, the schema created, empty.
func Schema(t testing.TB) (url, schema string) {
	t.Helper()
	url, schema = SchemaName(t)
	if err := exec(url, "CREATE SCHEMA "+schema); err != nil {
		t.Fatalf("creating schema %s: %v", schema, err)
	}
	return url, schema
}

// PoolOption adjusts the configuration of the pool Pool opens.
type PoolOption func(*pgxpool.Config)

// MaxConns sets the pool's size. Tests of several packages run in parallel
// against one server, so each keeps its share of connections small: the
// default is DefaultMaxConns.
func MaxConns(n int32) PoolOption {
	return func(c *pgxpool.Config) { c.MaxConns = n }
}

// DefaultMaxConns is the size of Pool's pools unless MaxConns says otherwise.
const DefaultMaxConns = 6

// Pool creates an empty schema for t (see Schema) and returns a pool whose
// connections use it (search_path). The pool is closed when t ends, before
// the schema is dropped.
func Pool(t testing.TB, opts ...PoolOption) *pgxpool.Pool {
	t.Helper()
	return PoolOn(t, URL(t), opts...)
}

// PoolOn is Pool on the database at url (one that Database or
// DatabaseWith made, say) instead of TEST_DATABASE_URL's.
func PoolOn(t testing.TB, url string, opts ...PoolOption) *pgxpool.Pool {
	t.Helper()
	schema := newName()
	if err := exec(url, "CREATE SCHEMA "+schema); err != nil {
		t.Fatalf("creating schema %s: %v", schema, err)
	}
	t.Cleanup(func() {
		if err := exec(url, "DROP SCHEMA IF EXISTS "+schema+" CASCADE"); err != nil {
			t.Errorf("dropping schema %s: %v", schema, err)
		}
	})
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("parsing %s: %v", url, err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = DefaultMaxConns
	for _, o := range opts {
		o(cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("pool on schema %s: %v", schema, err)
	}
	t.Cleanup(pool.Close)
	return pool
}
