package ordersapp

import (
	"context"
	"fmt"
	"net/http"
	neturl "net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/pgtest"
)

// withQuery returns dbURL with the query parameters kv (name, value, …).
func withQuery(t *testing.T, dbURL string, kv ...string) string {
	t.Helper()
	u, err := neturl.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	for i := 0; i+1 < len(kv); i += 2 {
		q.Set(kv[i], kv[i+1])
	}
	u.RawQuery = q.Encode()
	return u.String()
}

// serveStorm starts n in-process order services on dbURL (one NATS
// between them), sends keys × copies order requests over them at once
// through a retrying client, and checks that every request ends 201, that
// each key made exactly one order and one payment, and that the audit is
// clean. It returns the instances.
func serveStorm(t *testing.T, dbURL string, n, keys, copies int) []*inProcess {
	t.Helper()
	dir := t.TempDir()
	natsURL := testNATS(t)
	var insts []*inProcess
	for range n {
		insts = append(insts, startInProcess(t, &Config{DatabaseURL: dbURL, DataDir: dir, JWTSecret: testSecret, PaymentsKey: "sk_test_local",
			NATSURL: natsURL, KeyTTL: 24 * time.Hour, KeyLease: 30 * time.Second, RequireKey: true}))
	}
	// The first request alone: a store that cannot claim answers 503 here.
	if s, err := post(http.DefaultClient, insts[0].base, "setup-user", "setup-first", 0); err != nil || s != http.StatusCreated {
		t.Fatalf("first order: %d, %v; want 201", s, err)
	}
	hc := retrying()
	var mu sync.Mutex
	final := map[int]int{}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 12)
	for k := range keys {
		for c := range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sem <- struct{}{}
				defer func() { <-sem }()
				s, err := post(hc, insts[(k+c)%n].base, fmt.Sprintf("setup-user-%d", k%3), fmt.Sprintf("setup-%d", k), k)
				if err != nil {
					t.Errorf("key %d copy %d: %v", k, c, err)
				}
				mu.Lock()
				final[s]++
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	if final[http.StatusCreated] != keys*copies {
		t.Errorf("final answers %v, want %d × 201", final, keys*copies)
	}
	rep, err := runAudit(context.Background(), insts[0].srv.backend, insts[0].srv.payer, insts[0].srv.broker.js, nil)
	if err != nil {
		t.Fatalf("audit: %v", err)
	}
	if rep.ChargesSucceeded != keys+1 || len(rep.Violations) != 0 {
		t.Errorf("audit: %d succeeded payments, violations %v; want %d, none", rep.ChargesSucceeded, rep.Violations, keys+1)
	}
	return insts
}

// The service works under each of pgx's query modes named in the URL
// (default_query_exec_mode): exec and simple_protocol, which sent the kept
// request header to its jsonb column as bytea and answered 503 to every
// POST, and the three others.
func TestServeUnderEveryQueryMode(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"cache_statement", "cache_describe", "describe_exec", "exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			serveStorm(t, withQuery(t, pgtest.Database(t), "default_query_exec_mode", mode), 1, 10, 3)
		})
	}
}

// Three instances whose DATABASE_URL points at PgBouncer in transaction
// pooling mode, with nothing else changed, migrate, serve a storm of
// duplicates and pass the audit. PgBouncer refuses the startup parameter
// idle_in_transaction_session_timeout: serve connects without it and says
// what to set instead.
func TestServeBehindPgBouncer(t *testing.T) {
	b := pgtest.NewBouncer(t)
	db := pgtest.Database(t)
	u, err := neturl.Parse(db)
	if err != nil {
		t.Fatal(err)
	}
	insts := serveStorm(t, b.URL(u.Path[1:]), 3, 30, 4)
	if !strings.Contains(insts[0].logs.String(), "refuses idle_in_transaction_session_timeout as a startup parameter") {
		t.Errorf("no warning about idle_in_transaction_session_timeout in the logs:\n%s", tail(insts[0].logs.String(), 20))
	}
}

// On a database whose encoding is SQL_ASCII (as pg_autoctl makes it
// under the C locale), the service's pool sets client_encoding UTF8, and a
// URL that asks for SQL_ASCII itself still gets its orders completed.
func TestServeOnSQLASCIIDatabase(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, param string }{{"default", ""}, {"client_encoding=SQL_ASCII", "SQL_ASCII"}} {
		t.Run(c.name, func(t *testing.T) {
			db := pgtest.DatabaseWith(t, pgtest.SQLASCII)
			if n := countRows(t, db, `SELECT CASE WHEN pg_encoding_to_char(encoding) = 'SQL_ASCII' THEN 1 ELSE 0 END FROM pg_database WHERE datname = current_database()`); n != 1 {
				t.Fatal("the database is not SQL_ASCII")
			}
			if c.param != "" {
				db = withQuery(t, db, "client_encoding", c.param)
			}
			serveStorm(t, db, 1, 10, 3)
		})
	}
}
