// Package pgtest gives tests a PostgreSQL server to talk to: its address
// comes from TEST_DATABASE_URL; without it a test skips, except under CI=true
// where the machine's server is used and must answer.
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
	admin := URL(t)
	var b [6]byte
	rand.Read(b[:])
	name := "t_" + hex.EncodeToString(b[:])
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, admin)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("creating database %s: %v", name, err)
	}
	t.Cleanup(func() {
		conn, err := pgx.Connect(ctx, admin)
		if err != nil {
			t.Logf("dropping database %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
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
