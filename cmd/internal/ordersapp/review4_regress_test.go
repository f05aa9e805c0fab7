package ordersapp

// Regression tests from the fourth adversarial review of issue 8 (the
// search-failure fallback of 1be5eaf, the Redis prefix of 0fb1a7d). Each
// failed on main as of dac673d.

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
)

// review4SearchDown is the in-process payer with its search failing (a
// database blip during the lookup, say), its payments working.
type review4SearchDown struct{ payer }

func (p review4SearchDown) FindPayment(context.Context, string) (orders.PaymentResult, bool, error) {
	return orders.PaymentResult{}, false, errors.New("review4: search unavailable")
}

// TestReview4RaisedKeyTTLFallbackPaysTwice: when the lookup of an earlier
// attempt's payment fails, the handler pays with the operation's key if
// the operation is younger than PaymentKeyRetention less 1h, and serve
// computes PaymentKeyRetention from the *present* --key-ttl
// (max(--key-ttl, 24h) for the in-process gateway). But the gateway's key
// keeps the retention it was created with: the idem store fixes
// expires_at when the key is first used. So after serve is restarted with
// a longer --key-ttl (24h → 48h; or, in a rolling change, on the
// instances already running the new value), an unanswered operation paid
// under the old retention and retried 25 hours later, when the search
// fails, is judged "young" (25h < 47h) and pays with a key the gateway
// has already forgotten: a second charge, the first payment left without
// its order.
//
// Real PostgreSQL, the in-process gateway as serve builds it. The first
// attempt pays (gateway retention 24h, serve's with --key-ttl 24h) and
// its order INSERT fails transiently (503). serve restarts with --key-ttl
// 48h. 25 hours pass: the gateway key is aged in SQL (as its Claim sees
// it by the database's clock) and the handler's clock runs 25h ahead. The
// retry's lookup fails.
func TestReview4RaisedKeyTTLFallbackPaysTwice(t *testing.T) {
	ctx := context.Background()
	db := pgtest.Database(t)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	c1 := Config{DataDir: t.TempDir(), DatabaseURL: db, JWTSecret: testSecret, KeyTTL: 24 * time.Hour, KeyLease: 2 * time.Second,
		PaymentsKey: "sk_test_local", RequireKey: true}
	be, err := openBackend(ctx, &c1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.close() })
	gstore, ledger, err := be.gateway(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pgExec(t, db, blipTrigger...)

	// handler builds the order API as serve does with config c, its clock
	// shifted by skew, the gateway's search failing if searchDown.
	handler := func(c *Config, skew time.Duration, searchDown bool) *httptest.Server {
		gw := payments.NewServer(payments.Config{APIKey: "sk_test_local", Store: gstore, Ledger: ledger,
			KeyRetention: gatewayKeyRetention(c), Logger: quiet})
		pc := payments.NewClient(payments.ClientConfig{BaseURL: payments.InProcessURL, APIKey: "sk_test_local", HTTPClient: payments.InProcess(gw)})
		var p orders.Payer = payer{c: pc, gw: gw}
		if searchDown {
			p = review4SearchDown{payer{c: pc, gw: gw}}
		}
		h := orders.NewHandler(orders.Config{Repo: be.repo, Payer: p, Idem: be.store, Secret: []byte(testSecret),
			IdemOptions: idem.Options{TTL: c.KeyTTL, Lease: c.KeyLease}, Logger: quiet,
			Now:                 func() time.Time { return time.Now().Add(skew) },
			PaymentKeyRetention: paymentKeyRetention(c)})
		hs := httptest.NewServer(h)
		t.Cleanup(hs.Close)
		return hs
	}
	tok, err := orders.IssueToken([]byte(testSecret), "raised-ttl", 72*time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	send := func(base string) (int, string) {
		req, _ := http.NewRequest("POST", base+"/v1/orders", strings.NewReader(orderBody(5)))
		req.Header.Set("Authorization", "Bearer "+tok)
		req.Header.Set("Idempotency-Key", "order-raised")
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}

	before := handler(&c1, 0, false)
	if s, b := send(before.URL); s != http.StatusServiceUnavailable {
		t.Fatalf("first attempt: %d %s; want 503 (paid, order write refused once)", s, b)
	}
	// 25 hours later, serve runs with --key-ttl 48h.
	pgExec(t, db, `UPDATE payments.idempotency_keys SET created_at = created_at - interval '25 hours',
		completed_at = completed_at - interval '25 hours', expires_at = expires_at - interval '25 hours'`,
		`DELETE FROM review_blip`)
	c2 := c1
	c2.KeyTTL = 48 * time.Hour
	after := handler(&c2, 25*time.Hour, true)
	s, b := send(after.URL)
	succeeded := countRows(t, db, `SELECT count(*) FROM payments.payment_intents WHERE status = 'succeeded'`)
	if succeeded != 1 {
		t.Errorf("retry 25h later with --key-ttl raised to 48h and the search down: %d %s; %d succeeded payments for one operation, want 1: "+
			"serve judged the operation young by today's retention (%v), but the gateway key kept the 24h it was made with",
			s, tail(b, 200), succeeded, paymentKeyRetention(&c2))
	}
}

// review4Cluster runs a private PostgreSQL cluster from data directory
// dir on a free port (as the postgres OS user when the test runs as
// root), and returns its URL and a stop function. It skips when the
// server binaries are missing.
func review4Cluster(t *testing.T, dir string, initdb bool) (url string, stop func()) {
	t.Helper()
	bin := "/usr/lib/postgresql/15/bin/"
	if _, err := os.Stat(bin + "postgres"); err != nil {
		t.Skip("no PostgreSQL server binaries at " + bin)
	}
	as := func(name string, args ...string) *exec.Cmd {
		if os.Geteuid() == 0 {
			return exec.Command("runuser", append([]string{"-u", "postgres", "--", bin + name}, args...)...)
		}
		return exec.Command(bin+name, args...)
	}
	if initdb {
		if out, err := as("initdb", "-D", dir, "-A", "trust", "-U", "root").CombinedOutput(); err != nil {
			t.Fatalf("initdb: %v\n%s", err, out)
		}
	}
	addr := freeAddr(t)
	port := addr[strings.LastIndex(addr, ":")+1:]
	if out, err := as("pg_ctl", "-D", dir, "-w", "-t", "30", "-l", dir+"/log",
		"-o", "-p "+port+" -k "+dir+" -c listen_addresses=127.0.0.1", "start").CombinedOutput(); err != nil {
		t.Fatalf("pg_ctl start: %v\n%s", err, out)
	}
	stop = func() { _ = as("pg_ctl", "-D", dir, "-m", "fast", "-w", "stop").Run() } // cleanup, best effort
	return "postgres://root@127.0.0.1:" + port + "/postgres", stop
}

// TestReview4PhysicalCopySharesRedisPrefix: 0fb1a7d mixes the cluster's
// system identifier, the database's oid and the schema into the Redis
// prefix so that "a copied database never shares entries with its
// original" (README: "copies of one database included"). A physical copy
// (a restored volume or provider snapshot, pg_basebackup, a PITR restore,
// a promoted replica split off as staging: the usual ways of making
// staging from production) keeps all three and the deployment row, so
// the copy and its original still share one prefix: on one Redis,
// deployment B replays an answer of deployment A that B's database never
// saw, charges nothing and makes no order. Here: a private cluster,
// migrated, stopped, its data directory copied, both started.
func TestReview4PhysicalCopySharesRedisPrefix(t *testing.T) {
	ctx := context.Background()
	redisURL := redisURL(t)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	root, err := os.MkdirTemp("", "review4-pg-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	if err := os.Chmod(root, 0o777); err != nil {
		t.Fatal(err)
	}
	dirA, dirB := filepath.Join(root, "a"), filepath.Join(root, "b")
	if os.Geteuid() == 0 {
		if out, err := exec.Command("install", "-d", "-o", "postgres", "-m", "0700", dirA).CombinedOutput(); err != nil {
			t.Fatalf("install -d %s: %v\n%s", dirA, err, out)
		}
	}
	// One data dir per deployment: an instance on another one would run
	// an embedded NATS of its own, which its database refuses.
	dirs := map[string]string{}
	cfg := func(db string) *Config {
		if dirs[db] == "" {
			dirs[db] = t.TempDir()
		}
		return &Config{DataDir: dirs[db], DatabaseURL: db, RedisURL: redisURL, JWTSecret: testSecret,
			KeyTTL: time.Hour, KeyLease: 2 * time.Second, PaymentsKey: "sk_test_local", RequireKey: true}
	}
	dbA, stopA := review4Cluster(t, dirA, true)
	srv, err := (&App{}).newServer(ctx, cfg(dbA), quiet) // migrates
	if err != nil {
		stopA()
		t.Fatal(err)
	}
	srv.close()
	stopA()
	if out, err := exec.Command("cp", "-a", dirA, dirB).CombinedOutput(); err != nil {
		t.Fatalf("copy: %v %s", err, out)
	}
	dataA := dirs[dbA]
	dbA, stopA = review4Cluster(t, dirA, false)
	t.Cleanup(stopA)
	dbB, stopB := review4Cluster(t, dirB, false)
	t.Cleanup(stopB)
	// The restarted clusters may listen on other ports (or B on A's old
	// one): A keeps its data dir, B gets one of its own.
	dirs = map[string]string{dbA: dataA, dbB: t.TempDir()}
	// The copy records the original's stream of events; deployment B has
	// an embedded NATS of its own: its operator forgets the original's
	// stream first (see the README).
	pgExec(t, dbB, `DELETE FROM event_stream`)

	var bases []string
	for _, db := range []string{dbA, dbB} {
		srv, err := (&App{}).newServer(ctx, cfg(db), quiet)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.close)
		hs := httptest.NewServer(srv.handler)
		t.Cleanup(hs.Close)
		bases = append(bases, hs.URL)
	}
	wantDeploymentsApart(t, bases[0], bases[1], dbB, "physical-", "deployment B (a physical copy of A's cluster, one Redis)")
}
