package ordersapp

// A database copied from another, logically or physically, gets a Redis
// prefix of its own. Regression tests from the third adversarial review
// of issue 8 (failed on main as of 970c2de) and the fourth (failed on main
// as of dac673d), on the assembled service.

import (
	"context"
	"io"
	"log/slog"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/pgtest"
)

// TestClonedDatabaseGetsItsOwnRedisPrefix checks that a database made from
// another (a template, a restored dump, a copied file) gets a Redis prefix
// of its own.
//
// It guards a bug found in review 3, as it was found: the Redis prefix is a random
// id kept as a row of the database (table deployment), so it travels with
// the data: a database made from another (CREATE DATABASE … TEMPLATE, a
// pg_dump restored, a SQLite file or data dir copied — how a staging
// database is commonly made from production's) carries the same id. Two
// such deployments that share one Redis (the case 13fdec4 was for:
// staging and production on one managed Redis) share every entry again:
// deployment B replays, byte for byte, an answer of deployment A that B's
// database never saw, charges nothing and makes no order.
func TestClonedDatabaseGetsItsOwnRedisPrefix(t *testing.T) {
	ctx := context.Background()
	redisURL := redisURL(t)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))

	// Deployment A's database, migrated (serve migrates at start).
	dbA := pgtest.Database(t)
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
	srvA, err := (&App{}).newServer(ctx, cfg(dbA), quiet)
	if err != nil {
		t.Fatal(err)
	}
	srvA.close()

	// Deployment B's database: a copy of A's, made before A took traffic.
	admin := pgtest.URL(t)
	ua, _ := url.Parse(dbA)
	nameA := strings.TrimPrefix(ua.Path, "/")
	nameB := nameA + "_clone"
	pgExec(t, admin, "CREATE DATABASE "+nameB+" TEMPLATE "+nameA)
	t.Cleanup(func() { pgExec(t, admin, "DROP DATABASE IF EXISTS "+nameB+" WITH (FORCE)") })
	ub := *ua
	ub.Path = "/" + nameB
	dbB := ub.String()
	// A copy of a database records the stream of the original's
	// events; deployment B has an embedded NATS of its own: its operator
	// forgets the original's stream first (see the README).
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
	wantDeploymentsApart(t, bases[0], bases[1], dbB, "cloned-", "deployment B (a copy of A's database, one Redis)")
}

// physicalCopyCluster runs a private PostgreSQL cluster from data directory
// dir on a free port (as the postgres OS user when the test runs as
// root), and returns its URL and a stop function. It skips when the
// server binaries are missing.
func physicalCopyCluster(t *testing.T, dir string, initdb bool) (url string, stop func()) {
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

// TestPhysicalCopyGetsItsOwnRedisPrefix checks that a physical copy of the
// database's cluster gets a Redis prefix of its own, apart from its
// original's.
//
// It guards a bug found in the fourth review of issue 8 (it failed on main as of dac673d), as it was found: 0fb1a7d mixes the cluster's
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
func TestPhysicalCopyGetsItsOwnRedisPrefix(t *testing.T) {
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
	dbA, stopA := physicalCopyCluster(t, dirA, true)
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
	dbA, stopA = physicalCopyCluster(t, dirA, false)
	t.Cleanup(stopA)
	dbB, stopB := physicalCopyCluster(t, dirB, false)
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
