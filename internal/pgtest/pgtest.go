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
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		t.Fatalf("PostgreSQL at %s does not answer: %v", u, err)
	}
	conn.Close(ctx)
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
	t.Cleanup(func() {
		if err := exec(admin, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Logf("dropping database %s: %v", name, err)
		}
	})
	u, err := url.Parse(admin)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	return u.String()
}

// exec runs one statement on a connection of its own to the server at u.
func exec(u, sql string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
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
