package ordersapp

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
)

// TestCleanerDeletesGatewayKeys (issue 8, point 7): serve's background
// cleaner deletes the in-process gateway's expired idempotency keys, beside
// the order store's, and leaves its live keys and its payments alone; so
// does `orders gc`. The keys are aged behind the service's back (their
// retention is at least 24h); the cleaner's first pass runs when serve
// starts.
func TestCleanerDeletesGatewayKeys(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) {
		dir := t.TempDir()
		gwFile := filepath.Join(dir, "orders-payments.db")
		cleanerDeletesGatewayKeys(t, Config{DataDir: dir}, func(query string) (int64, error) {
			// The service's cleaner may hold the file's write lock.
			db, err := sql.Open("sqlite", gwFile+"?_pragma=busy_timeout(10000)")
			if err != nil {
				return 0, err
			}
			defer db.Close()
			if strings.HasPrefix(query, "SELECT") {
				var n int64
				err := db.QueryRow(query).Scan(&n)
				return n, err
			}
			res, err := db.Exec(query)
			if err != nil {
				return 0, err
			}
			return res.RowsAffected()
		})
	})
	t.Run("postgres", func(t *testing.T) {
		dbURL := pgtest.Database(t)
		cleanerDeletesGatewayKeys(t, Config{DataDir: t.TempDir(), DatabaseURL: dbURL}, func(query string) (int64, error) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			conn, err := pgx.Connect(ctx, dbURL)
			if err != nil {
				return 0, err
			}
			defer conn.Close(ctx)
			query = strings.ReplaceAll(query, "idempotency_keys", payments.DefaultSchema+".idempotency_keys")
			if strings.HasPrefix(query, "SELECT") {
				var n int64
				err := conn.QueryRow(ctx, query).Scan(&n)
				return n, err
			}
			tag, err := conn.Exec(ctx, query)
			return tag.RowsAffected(), err
		})
	})
}

// cleanerDeletesGatewayKeys makes orders on the service c describes, ages
// some of its gateway's keys with exec (a statement on the gateway's
// idempotency_keys table: a SELECT count, or a change that returns how
// many rows it changed), restarts the service and waits for its cleaner.
func cleanerDeletesGatewayKeys(t *testing.T, c Config, exec func(query string) (int64, error)) {
	const payKey = "sk_test_local"
	c.JWTSecret, c.KeyTTL, c.KeyLease, c.RequireKey, c.PaymentsKey = testSecret, time.Hour, 30*time.Second, true, payKey
	svc := startInProcess(t, &c)
	const n = 5
	for i := 0; i < n; i++ {
		if s, err := post(http.DefaultClient, svc.base, "cleaner", fmt.Sprintf("clean-%d", i), i); s != http.StatusCreated {
			t.Fatalf("order %d: %d %v", i, s, err)
		}
	}
	svc.stop()

	count := func() int {
		t.Helper()
		got, err := exec(`SELECT count(*) FROM idempotency_keys`)
		if err != nil {
			t.Fatalf("counting the gateway's keys: %v", err)
		}
		return int(got)
	}
	if got := count(); got != n {
		t.Fatalf("the gateway holds %d keys, want %d", got, n)
	}
	// Age all but two: their retention ended an hour ago.
	aged, err := exec(`UPDATE idempotency_keys SET expires_at = created_at WHERE key IN (SELECT key FROM idempotency_keys ORDER BY key LIMIT 3)`)
	if err != nil || aged != 3 {
		t.Fatalf("ageing the gateway's keys: %d aged, %v", aged, err)
	}

	svc = startInProcess(t, &c)
	left := count()
	for deadline := time.Now().Add(10 * time.Second); left != n-3 && time.Now().Before(deadline); left = count() {
		time.Sleep(20 * time.Millisecond) // a poll with a deadline: ends as soon as the cleaner's pass is seen
	}
	if left != n-3 {
		t.Fatalf("the gateway holds %d keys after the cleaner's first pass, want %d\n%s", left, n-3, svc.logs.String())
	}
	// The sweep logs after its delete commits: wait for the line.
	logged := func() bool {
		logs := svc.logs.String()
		return strings.Contains(logs, "in-process gateway's expired keys") && strings.Contains(logs, "count=3")
	}
	for deadline := time.Now().Add(5 * time.Second); !logged() && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond) // a poll with a deadline: ends as soon as the line is written
	}
	if !logged() {
		t.Errorf("the cleaner did not log what it deleted:\n%s", svc.logs.String())
	}
	pis, err := payments.ListAll(context.Background(), svc.srv.ledger, payments.AccountFor(payKey))
	if err != nil {
		t.Fatal(err)
	}
	if len(pis) != n {
		t.Errorf("%d payments after cleaning, want %d: the cleaner deletes keys, not payments", len(pis), n)
	}
	// The order store's keys live an hour: the cleaner keeps them.
	for i := 0; i < n; i++ {
		if _, err := svc.srv.backend.store.Get(context.Background(), "cleaner", fmt.Sprintf("clean-%d", i)); err != nil {
			t.Errorf("order key clean-%d: %v", i, err)
		}
	}
	svc.stop()

	// `orders gc` deletes the gateway's expired keys too.
	if aged, err := exec(`UPDATE idempotency_keys SET expires_at = created_at`); err != nil || aged != n-3 {
		t.Fatalf("ageing the gateway's keys: %d aged, %v", aged, err)
	}
	args := []string{"gc", "--data-dir", c.DataDir}
	if c.DatabaseURL != "" {
		args = append(args, "--database-url", c.DatabaseURL)
	}
	code, out, errs := run(t, nil, args...)
	if code != 0 || !strings.Contains(out, "deleted 0 expired keys in") || !strings.Contains(out, fmt.Sprintf("deleted %d expired keys of the in-process gateway", n-3)) {
		t.Errorf("orders gc: exit %d\n%s%s", code, out, errs)
	}
	if left := count(); left != 0 {
		t.Errorf("the gateway holds %d keys after orders gc, want 0", left)
	}
}
