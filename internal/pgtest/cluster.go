package pgtest

import (
	"context"
	"fmt"
	"net"
	"os"
	osexec "os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Cluster is a throwaway PostgreSQL cluster of a test's own, made with
// Debian's postgresql-common tools (pg_createcluster, pg_ctlcluster,
// pg_dropcluster) on a free port of 127.0.0.1, trust authentication,
// with a superuser role root and an empty database test. A test may
// restart or stop it at will; the machine's shared cluster (port 5432)
// is never touched.
type Cluster struct {
	Version string // major version, e.g. "15"
	Name    string // the cluster's name, unique to the test
	Port    int
	// URL is postgres://root@127.0.0.1:Port/test.
	URL string
	// LogFile is the server's log (removed with the cluster).
	LogFile string
}

// NewCluster creates and starts a cluster for t and drops it (stopping
// it first) when t ends. It needs root, as CI has, and the
// postgresql-common tools: without them it skips t, except under CI=true,
// where it fails.
func NewCluster(t testing.TB) *Cluster {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: starts a PostgreSQL cluster of its own (the full suite runs it)")
	}
	unable := func(why string) {
		t.Helper()
		if os.Getenv("CI") == "true" {
			t.Fatalf("a throwaway PostgreSQL cluster is needed under CI: %s", why)
		}
		t.Skipf("throwaway PostgreSQL cluster skipped: %s (runs as root, and under CI=true)", why)
	}
	if os.Geteuid() != 0 {
		unable("not running as root")
	}
	for _, tool := range []string{"pg_createcluster", "pg_ctlcluster", "pg_dropcluster"} {
		if _, err := osexec.LookPath(tool); err != nil {
			unable(tool + " not found (Debian's postgresql-common)")
		}
	}
	version := newestServer()
	if version == "" {
		unable("no PostgreSQL server in /usr/lib/postgresql")
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	c := &Cluster{Version: version, Name: strings.Replace(newName(), "t_", "idemtest_", 1), Port: port}
	c.URL = fmt.Sprintf("postgres://root@127.0.0.1:%d/test", port)
	c.LogFile = fmt.Sprintf("/var/log/postgresql/postgresql-%s-%s.log", c.Version, c.Name)

	// Dropped even when the creation failed half way.
	t.Cleanup(func() {
		if out, err := osexec.Command("pg_dropcluster", "--stop", c.Version, c.Name).CombinedOutput(); err != nil {
			t.Logf("pg_dropcluster %s %s: %v\n%s", c.Version, c.Name, err, out)
		}
	})
	create := []string{c.Version, c.Name, "--port", fmt.Sprint(port), "--start-conf", "manual",
		"-o", "max_connections=100", "-o", "shared_buffers=32MB",
		"-o", "fsync=on", "-o", "ssl=off",
		"--", "--auth=trust"}
	if out, err := osexec.Command("pg_createcluster", create...).CombinedOutput(); err != nil {
		t.Fatalf("pg_createcluster %s: %v\n%s", strings.Join(create, " "), err, out)
	}
	if err := c.ctl("start"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port))
	if err != nil {
		t.Fatalf("cluster %s: %v", c.Name, err)
	}
	defer admin.Close(ctx)
	for _, stmt := range []string{"CREATE ROLE root SUPERUSER LOGIN", "CREATE DATABASE test OWNER root"} {
		if _, err := admin.Exec(ctx, stmt); err != nil {
			t.Fatalf("cluster %s: %s: %v", c.Name, stmt, err)
		}
	}
	return c
}

// Restart restarts the cluster with pg_ctlcluster in the given shutdown
// mode ("smart", "fast" or "immediate"; immediate makes the start a crash
// recovery), and returns once it accepts connections again.
func (c *Cluster) Restart(mode string) error {
	return c.ctl("restart", "-m", mode)
}

// Stop stops the cluster in the given shutdown mode.
func (c *Cluster) Stop(mode string) error { return c.ctl("stop", "-m", mode) }

// Start starts a stopped cluster.
func (c *Cluster) Start() error { return c.ctl("start") }

// Log returns the server's log so far.
func (c *Cluster) Log() string {
	b, _ := os.ReadFile(c.LogFile)
	return string(b)
}

func (c *Cluster) ctl(action string, opts ...string) error {
	// --skip-systemctl-redirect: run pg_ctl directly, as CI's machine
	// has no systemd to hand the cluster to.
	args := append([]string{"--skip-systemctl-redirect"}, opts...)
	args = append(args, c.Version, c.Name, action)
	out, err := osexec.Command("pg_ctlcluster", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("pg_ctlcluster %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

// newestServer returns the newest major version installed under
// /usr/lib/postgresql, or "".
func newestServer() string {
	paths, _ := filepath.Glob("/usr/lib/postgresql/*/bin/postgres")
	var versions []int
	for _, p := range paths {
		var v int
		if _, err := fmt.Sscan(filepath.Base(filepath.Dir(filepath.Dir(p))), &v); err == nil {
			versions = append(versions, v)
		}
	}
	if len(versions) == 0 {
		return ""
	}
	sort.Ints(versions)
	return fmt.Sprint(versions[len(versions)-1])
}
