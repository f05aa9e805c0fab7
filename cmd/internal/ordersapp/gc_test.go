package ordersapp

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/idemdriver"
	"github.com/redis/go-redis/v9"
)

// TestMigrateAndGC: migrate makes the schema; gc deletes the expired
// answered keys, leaves the live ones and those without an answer (their
// attempt may have paid), and reports how many it deleted.
func TestMigrateAndGC(t *testing.T) {
	dir := t.TempDir()
	if code, out, errs := run(t, nil, "migrate", "--data-dir", dir); code != 0 || !strings.Contains(out, "schema up to date") {
		t.Fatalf("migrate: exit %d %q %q", code, out, errs)
	}
	ctx := context.Background()
	c := Config{DataDir: dir}
	be, err := openBackend(ctx, &c)
	if err != nil {
		t.Fatal(err)
	}
	claim := func(key string, ttl time.Duration, answer bool) {
		t.Helper()
		cl, err := be.store.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: key, Fingerprint: "f", Method: "POST", Path: "/v1/orders", TTL: ttl, Lease: time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		if !answer {
			return
		}
		tx, err := be.store.Begin(ctx, cl.Lease)
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 25; i++ {
		claim(fmt.Sprintf("old-%d", i), time.Millisecond, true)
	}
	claim("unanswered", time.Millisecond, false)
	claim("live", time.Hour, true)
	be.close()
	time.Sleep(10 * time.Millisecond) // not waiting for an outcome: the wall clock `orders gc` reads passes the 1ms TTLs

	code, out, errs := run(t, nil, "gc", "--data-dir", dir, "--batch", "10")
	if code != 0 || !strings.Contains(out, "deleted 25 expired keys") {
		t.Fatalf("gc: exit %d %q %q", code, out, errs)
	}
	be, err = openBackend(ctx, &c)
	if err != nil {
		t.Fatal(err)
	}
	defer be.close()
	for _, k := range []string{"live", "unanswered"} {
		if _, err := be.store.Get(ctx, "u", k); err != nil {
			t.Errorf("%s key: %v", k, err)
		}
	}
}

func TestRedisURLForms(t *testing.T) {
	one, err := newRedis("redis://127.0.0.1:6379/0")
	if err != nil {
		t.Fatal(err)
	}
	defer one.Close()
	if _, ok := one.(*redis.Client); !ok {
		t.Errorf("one server: got %T, want *redis.Client", one)
	}
	cluster, err := newRedis("redis://127.0.0.1:7000?addr=127.0.0.1:7001&addr=127.0.0.1:7002")
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	cc, ok := cluster.(*redis.ClusterClient)
	if !ok {
		t.Fatalf("cluster form: got %T, want *redis.ClusterClient", cluster)
	}
	if got := len(cc.Options().Addrs); got != 3 {
		t.Errorf("cluster addresses = %d, want 3", got)
	}
	for _, bad := range []string{"http://x", "redis://host:notaport", "::"} {
		if code, _, errs := run(t, nil, "serve", "--redis-url", bad, "--data-dir", t.TempDir()); code != 2 {
			t.Errorf("--redis-url %q: exit %d (%s), want 2", bad, code, errs)
		}
	}
}

// TestAuditFindsViolations: audit is clean after real orders, and exits 1
// once an order is removed behind the service's back (its stored answer,
// its payment and its orders.created event are then without it).
func TestAuditFindsViolations(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	c := Config{DataDir: dir, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: 30 * time.Second, PaymentsKey: "sk_test_local", RequireKey: true}
	srv, err := (&App{}).newServer(ctx, &c, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.handler)
	for i := 0; i < 3; i++ {
		if s, err := post(http.DefaultClient, hs.URL, "auditor", fmt.Sprintf("audit-%d", i), i); s != http.StatusCreated {
			t.Fatalf("order %d: %d %v", i, s, err)
		}
	}
	hs.Close()
	srv.close()

	code, out, errs := run(t, nil, "audit", "--data-dir", dir)
	if code != 0 || !strings.Contains(out, "orders:            3") || !strings.Contains(out, "OK: every invariant holds") {
		t.Fatalf("audit of a sound database: exit %d\n%s%s", code, out, errs)
	}
	db, err := sql.Open("sqlite", filepath.Join(dir, "orders.db"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`DELETE FROM orders WHERE id = (SELECT min(id) FROM orders)`); err != nil {
		t.Fatal(err)
	}
	db.Close()
	code, out, _ = run(t, nil, "audit", "--data-dir", dir)
	if code != 1 || !strings.Contains(out, "violations:        3") || !strings.Contains(out, "does not exist") || !strings.Contains(out, "has no order") ||
		!strings.Contains(out, "in the outbox has no order") {
		t.Errorf("audit after an order vanished: exit %d, want 1 and three violations (answer, payment, event)\n%s", code, out)
	}
}
