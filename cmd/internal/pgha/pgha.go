// Package pgha builds, for tests, a PostgreSQL primary and synchronous
// standbys on loopback, run by pg_auto_failover (Debian's
// postgresql-NN-auto-failover, binary pg_autoctl): a monitor and data
// nodes, each kept running by `pg_autoctl run` as a process the test
// process owns. A test can then switch the primary over (Failover) or
// crash it (Kill), and wait for a standby to take over (WaitNewPrimary).
//
// A formation takes seconds to build and to tear down, most of it
// initdb and base backups, so it can serve several tests: Start builds
// one for a test and tears it down when that test ends; Launch builds
// one that lives until its owner calls Stop (a TestMain, or the last of
// the tests that share it). A test on a formation that another test used
// calls RequireHealthy first: that test may have switched the primary
// over or killed it, and RequireHealthy brings a killed node back and
// waits until every node is in place again, within a bound, so that a
// formation left broken fails the next test instead of hanging it. Tests
// that share a formation keep their data apart in databases of their own
// (Database).
//
// It runs under CI=true, where pg_autoctl must be installed (.ci/run
// installs it), or when TEST_PG_AUTO_FAILOVER=1; elsewhere it skips
// (SkipUnlessEnabled). The processes run as the postgres OS user: the
// test must run as root (as CI does) or as postgres. Everything lives in
// a directory of its own under the system's temp dir (data directories,
// pg_autoctl's configuration and state, logs), on free loopback ports,
// and is torn down at the end: pg_autoctl asked to stop, then its process
// group and any process left on that directory killed, the directory
// removed.
package pgha

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// EnvVar opts in outside CI.
const EnvVar = "TEST_PG_AUTO_FAILOVER"

// Role is the superuser role the formation's URL connects as. pg_autoctl
// creates only postgres and its own roles; Start creates this one on the
// primary (the standby gets it by replication), as the machine's shared
// server has it.
const Role = "root"

// The monitor's health checks, tightened from pg_auto_failover's defaults
// (a check every 5 s, a node unhealthy after 20 s, 30 s for a lost primary
// to demote itself) so that a crashed primary is replaced within seconds.
// A keeper cut off from the monitor and its standby demotes its primary
// after networkPartitionTimeout, shorter than primaryDemoteTimeout, which
// is how long the monitor waits before it lets the standby take writes:
// the same order as the defaults (20 s < 30 s), so no split brain.
var monitorSettings = []string{
	"pgautofailover.health_check_period = 1000",
	"pgautofailover.health_check_timeout = 2000",
	"pgautofailover.health_check_max_retries = 1",
	"pgautofailover.health_check_retry_delay = 500",
	"pgautofailover.node_considered_unhealthy_timeout = 5000",
	"pgautofailover.primary_demote_timeout = 8000",
}

const networkPartitionTimeout = "4" // seconds, keeper's timeout.network_partition_timeout

// Node is the monitor or a data node.
type Node struct {
	Name   string
	Port   int
	PGData string

	logs   *logBuffer
	cmd    *exec.Cmd     // pg_autoctl run, leader of its process group
	done   chan struct{} // closed when cmd has exited and was reaped
	killed bool          // by Kill; RequireHealthy runs it again
}

// Formation is a running monitor, primary and standbys.
type Formation struct {
	dir     string
	autoctl string
	pgBin   string
	cred    *syscall.Credential
	env     []string

	Monitor *Node
	Nodes   []*Node // node1, node2[, node3]; node1 started as the primary

	url string // the formation's multi-host URL, user Role

	// SetupTook is how long the setup took, from the first pg_autoctl
	// command to a streaming synchronous standby; Setup says where the
	// formation lives and when each step of the setup ended.
	SetupTook time.Duration
	Setup     string

	stopOnce sync.Once
	stopErr  error
}

// Start builds a formation of a primary and standbys standbys (1 or 2)
// for t, and returns once a standby is streaming and synchronous (it
// fails t otherwise); the formation is torn down when t ends. It skips t
// unless CI=true or TEST_PG_AUTO_FAILOVER is set; once asked to run, a
// missing tool fails t.
//
// With one standby, pg_auto_failover keeps number_sync_standbys at 0: the
// primary falls back to asynchronous replication (wait_primary) whenever
// the monitor finds no healthy standby, and pg_auto_failover 2.0 can do
// so in the middle of `perform failover` (see Failover). With two, the
// monitor sets number_sync_standbys to 1 by itself when the third node
// registers: the primary then blocks writes rather than drop to
// asynchronous replication.
func Start(t testing.TB, standbys int) *Formation {
	t.Helper()
	SkipUnlessEnabled(t)
	f, err := Launch(standbys)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := f.Stop(); err != nil {
			t.Logf("pgha: %v", err)
		}
		if t.Failed() {
			t.Log(f.NodeLogs(40))
		}
	})
	t.Logf("pg_auto_failover formation %s", f.Setup)
	return f
}

// SkipUnlessEnabled skips t unless the pg_auto_failover tests are to run:
// CI=true or TEST_PG_AUTO_FAILOVER set. Start does it; a test on a
// formation from Launch does it before asking for one.
func SkipUnlessEnabled(t testing.TB) {
	t.Helper()
	if os.Getenv("CI") != "true" && os.Getenv(EnvVar) == "" {
		t.Skip("pg_auto_failover tests skipped: set " + EnvVar + "=1 or CI=true (needs pg_autoctl from Debian's postgresql-15-auto-failover, and root or the postgres user)")
	}
}

// Launch builds the formation that Start builds, for several tests to
// share: it fails no test but returns the error (with the last lines of
// every node's log), having torn down what it had started, and the
// formation lives until Stop, not until a test ends. It does not look at
// CI or TEST_PG_AUTO_FAILOVER: its caller does (SkipUnlessEnabled).
func Launch(standbys int) (f *Formation, err error) {
	if standbys < 1 || standbys > 2 {
		return nil, fmt.Errorf("pgha: %d standbys, want 1 or 2", standbys)
	}
	autoctl, pgBin, err := tools()
	if err != nil {
		return nil, fmt.Errorf("pg_auto_failover: %v (install Debian's postgresql-15-auto-failover; .ci/run does)", err)
	}
	cred, uid, gid, err := credential()
	if err != nil {
		return nil, fmt.Errorf("pg_auto_failover: %v", err)
	}
	dir, err := os.MkdirTemp("", "pgha-")
	if err != nil {
		return nil, err
	}
	if cred != nil {
		if err := os.Chown(dir, uid, gid); err != nil {
			os.RemoveAll(dir)
			return nil, err
		}
	}
	f = &Formation{dir: dir, autoctl: autoctl, pgBin: pgBin, cred: cred}
	f.env = []string{
		"PATH=" + pgBin + ":/usr/bin:/bin",
		"HOME=" + dir,
		"LC_ALL=C.UTF-8", // initdb makes UTF8 databases
		"XDG_CONFIG_HOME=" + filepath.Join(dir, "config"),
		"XDG_DATA_HOME=" + filepath.Join(dir, "share"),
		"XDG_RUNTIME_DIR=" + filepath.Join(dir, "run"),
	}
	defer func() {
		if err != nil {
			if serr := f.Stop(); serr != nil {
				err = fmt.Errorf("%w\npgha: %v", err, serr)
			}
			err = fmt.Errorf("%w\n%s", err, f.NodeLogs(40))
			f = nil
		}
	}()
	began := time.Now()
	var steps []string
	step := func(what string) { steps = append(steps, fmt.Sprintf("%s %.1fs", what, time.Since(began).Seconds())) }

	ports, err := freePorts(2 + standbys)
	if err != nil {
		return f, err
	}
	f.Monitor = &Node{Name: "monitor", Port: ports[0], PGData: filepath.Join(dir, "monitor"), logs: new(logBuffer)}
	if err := f.must("create monitor", "create", "monitor", "--pgdata", f.Monitor.PGData, "--pgport", strconv.Itoa(f.Monitor.Port),
		"--pgctl", filepath.Join(pgBin, "pg_ctl"), "--hostname", "127.0.0.1", "--listen", "127.0.0.1",
		"--auth", "trust", "--no-ssl", "--ssl-mode", "disable"); err != nil {
		return f, err
	}
	if err := f.appendConf(f.Monitor, monitorSettings); err != nil {
		return f, err
	}
	if err := f.run(f.Monitor); err != nil {
		return f, err
	}
	if err := f.wait("the monitor to answer", time.Minute, func(ctx context.Context) error {
		return f.query(ctx, f.Monitor, "pg_auto_failover", `SELECT 1`)
	}); err != nil {
		return f, err
	}
	step("monitor up")

	monitorURL := fmt.Sprintf("postgres://autoctl_node@127.0.0.1:%d/pg_auto_failover?sslmode=disable", f.Monitor.Port)
	for i := 1; i <= 1+standbys; i++ {
		n := &Node{Name: fmt.Sprintf("node%d", i), Port: ports[i], PGData: filepath.Join(dir, fmt.Sprintf("node%d", i)), logs: new(logBuffer)}
		f.Nodes = append(f.Nodes, n)
		if err := f.must("create postgres "+n.Name, "create", "postgres", "--pgdata", n.PGData, "--pgport", strconv.Itoa(n.Port),
			"--pgctl", filepath.Join(pgBin, "pg_ctl"), "--hostname", "127.0.0.1", "--listen", "127.0.0.1", "--name", n.Name,
			"--auth", "trust", "--no-ssl", "--ssl-mode", "disable", "--monitor", monitorURL); err != nil {
			return f, err
		}
		step(n.Name + " created")
		if err := f.must("config set "+n.Name, "config", "set", "--pgdata", n.PGData, "timeout.network_partition_timeout", networkPartitionTimeout); err != nil {
			return f, err
		}
		if err := f.run(n); err != nil {
			return f, err
		}
		if i == 1 {
			if err := f.wait("node1 to be the primary", time.Minute, func(ctx context.Context) error {
				if err := f.writable(ctx, n); err != nil {
					return err
				}
				return f.query(ctx, n, "postgres", `DO $$BEGIN
					IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '`+Role+`') THEN CREATE ROLE `+Role+` LOGIN SUPERUSER; END IF;
					END$$`)
			}); err != nil {
				return f, err
			}
			step("node1 primary")
		}
	}
	if err := f.wait("a primary and its secondaries", 2*time.Minute, func(ctx context.Context) error {
		p, err := f.settled(ctx)
		if err == nil && p.Name != "node1" {
			err = fmt.Errorf("primary %s, want node1", p.Name)
		}
		return err
	}); err != nil {
		return f, err
	}
	step("secondaries")
	if _, err := f.waitSynchronous(time.Minute); err != nil {
		return f, err
	}
	step("synchronous")
	out, err := f.Autoctl(context.Background(), "show", "uri", "--pgdata", f.Monitor.PGData, "--formation", "default")
	uri := strings.TrimSpace(out)
	if err != nil || !strings.HasPrefix(uri, "postgres://") || !strings.Contains(uri, "target_session_attrs=read-write") {
		return f, fmt.Errorf("pg_autoctl show uri: %v\n%s", err, out)
	}
	f.url = "postgres://" + Role + "@" + strings.TrimPrefix(uri, "postgres://")
	f.SetupTook = time.Since(began)
	f.Setup = fmt.Sprintf("in %s: %s", dir, strings.Join(steps, ", "))
	return f, nil
}

// Stop stops every process of the formation and removes its directory;
// it returns what it could not remove. Start's formation is stopped when
// its test ends; Launch's owner calls Stop. Later calls do nothing.
func (f *Formation) Stop() error {
	f.stopOnce.Do(func() { f.stopErr = f.teardown() })
	return f.stopErr
}

// NodeLogs returns the last lines of each node's pg_autoctl output
// (pg_autoctl and its postgres), for a failure message.
func (f *Formation) NodeLogs(lines int) string {
	var b strings.Builder
	for _, n := range append([]*Node{f.Monitor}, f.Nodes...) {
		if n != nil {
			fmt.Fprintf(&b, "pg_autoctl %s (port %d), last lines:\n%s\n", n.Name, n.Port, tailLines(n.logs.String(), lines))
		}
	}
	return strings.TrimRight(b.String(), "\n")
}

// URL is the formation's URL as `pg_autoctl show uri --formation default`
// prints it (every data node, target_session_attrs=read-write), connecting
// as Role: a client on it follows the primary.
func (f *Formation) URL() string { return f.url }

// Database creates a database of t's own on the formation's primary,
// with options appended to its CREATE DATABASE (an ENCODING, say), drops
// it when t ends, and returns the formation's URL for it: tests that
// share a formation keep their rows apart in databases of their own. A
// database's encoding and locale are in the catalog that physical
// replication carries: every standby, and whichever becomes the primary,
// has the database as it was created.
func (f *Formation) Database(t testing.TB, options string) string {
	t.Helper()
	var b [8]byte
	rand.Read(b[:])
	name := "t_" + hex.EncodeToString(b[:])
	if err := f.exec("CREATE DATABASE " + name + " " + options); err != nil {
		t.Fatalf("pgha: creating database %s: %v", name, err)
	}
	u, err := url.Parse(f.url)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	t.Cleanup(func() {
		if err := f.exec("DROP DATABASE IF EXISTS " + name + " WITH (FORCE)"); err != nil {
			t.Logf("pgha: dropping database %s: %v", name, err)
		}
	})
	return u.String()
}

// exec runs one statement on the primary, through URL, within 30 s.
func (f *Formation) exec(sql string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, f.url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, sql)
	return err
}

// NodeURL connects to n alone, as the postgres superuser.
func (f *Formation) NodeURL(n *Node, db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable&connect_timeout=5", n.Port, db)
}

// Autoctl runs one pg_autoctl command, as the postgres OS user in the
// formation's environment, and returns its combined output.
func (f *Formation) Autoctl(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	cmd := f.command(args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return "", err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		return out.String(), err
	case <-ctx.Done():
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		werr := <-done
		return out.String(), fmt.Errorf("pg_autoctl %s: %w (killed: %v)", strings.Join(args, " "), ctx.Err(), werr)
	}
}

// States maps each data node's name to "reported/assigned" state, as the
// monitor has them.
func (f *Formation) States(ctx context.Context) (map[string]string, error) {
	conn, err := f.connect(ctx, f.Monitor, "pg_auto_failover")
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, `SELECT nodename, reportedstate::text || '/' || goalstate::text FROM pgautofailover.node WHERE formationid = 'default'`)
	if err != nil {
		return nil, err
	}
	states := map[string]string{}
	for rows.Next() {
		var name, st string
		if err := rows.Scan(&name, &st); err != nil {
			return nil, err
		}
		states[name] = st
	}
	return states, rows.Err()
}

// settled returns the primary when the monitor has one node primary and
// every other a secondary, each node in the state it was assigned.
func (f *Formation) settled(ctx context.Context) (*Node, error) {
	states, err := f.States(ctx)
	if err != nil {
		return nil, err
	}
	var primary *Node
	for _, n := range f.Nodes {
		switch st := states[n.Name]; {
		case st == "primary/primary" && primary == nil:
			primary = n
		case st == "secondary/secondary":
		default:
			return nil, fmt.Errorf("states %v", states)
		}
	}
	if primary == nil {
		return nil, fmt.Errorf("no primary: states %v", states)
	}
	return primary, nil
}

// Primary returns the data node that takes writes now (asking each node
// itself, not the monitor).
func (f *Formation) Primary(ctx context.Context) (*Node, error) {
	var errs []error
	for _, n := range f.Nodes {
		err := f.writable(ctx, n)
		if err == nil {
			return n, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", n.Name, err))
	}
	return nil, errors.Join(errs...)
}

// Sync is what makes the standby synchronous, read on the primary.
type Sync struct {
	Primary      string
	StandbyNames string            // synchronous_standby_names
	Commit       string            // synchronous_commit
	Replicas     map[string]string // pg_stat_replication: application_name → "state/sync_state"
}

func (s Sync) String() string {
	return fmt.Sprintf("primary %s: synchronous_standby_names = %q, synchronous_commit = %s, pg_stat_replication %v",
		s.Primary, s.StandbyNames, s.Commit, s.Replicas)
}

// ok tells whether a commit on the primary waits for a standby to have
// the commit's WAL on disk: a standby named in synchronous_standby_names
// is streaming with sync_state sync or quorum, and synchronous_commit is
// on (flush) or remote_apply.
func (s Sync) ok() bool {
	if s.StandbyNames == "" || (s.Commit != "on" && s.Commit != "remote_apply") {
		return false
	}
	for app, st := range s.Replicas {
		if strings.Contains(s.StandbyNames, app) && (st == "streaming/sync" || st == "streaming/quorum") {
			return true
		}
	}
	return false
}

// Synchronous reads the primary's replication settings.
func (f *Formation) Synchronous(ctx context.Context) (Sync, error) {
	p, err := f.Primary(ctx)
	if err != nil {
		return Sync{}, err
	}
	conn, err := f.connect(ctx, p, "postgres")
	if err != nil {
		return Sync{}, err
	}
	defer conn.Close(context.Background())
	s := Sync{Primary: p.Name, Replicas: map[string]string{}}
	if err := conn.QueryRow(ctx, `SELECT current_setting('synchronous_standby_names'), current_setting('synchronous_commit')`).Scan(&s.StandbyNames, &s.Commit); err != nil {
		return s, err
	}
	rows, err := conn.Query(ctx, `SELECT application_name, state || '/' || sync_state FROM pg_stat_replication`)
	if err != nil {
		return s, err
	}
	for rows.Next() {
		var app, st string
		if err := rows.Scan(&app, &st); err != nil {
			return s, err
		}
		s.Replicas[app] = st
	}
	return s, rows.Err()
}

// RequireSynchronous waits up to timeout for the standby to be streaming
// and synchronous, and fails t if it is not.
func (f *Formation) RequireSynchronous(t testing.TB, timeout time.Duration) Sync {
	t.Helper()
	s, err := f.waitSynchronous(timeout)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func (f *Formation) waitSynchronous(timeout time.Duration) (Sync, error) {
	var s Sync
	err := f.wait("a synchronous standby", timeout, func(ctx context.Context) error {
		var err error
		s, err = f.synchronousNow(ctx)
		return err
	})
	return s, err
}

// synchronousNow returns the primary's replication settings, and an error
// describing them when no standby is streaming and synchronous.
func (f *Formation) synchronousNow(ctx context.Context) (Sync, error) {
	s, err := f.Synchronous(ctx)
	if err != nil {
		return s, err
	}
	if !s.ok() {
		return s, errors.New(s.String())
	}
	return s, nil
}

// RequireHealthy makes the formation whole again after another test used
// it, and fails t if it cannot within timeout: it runs pg_autoctl again
// for every node that Kill crashed (it rejoins as a standby, rewound if
// need be), then waits until the monitor has one node primary and every
// other a secondary, each in its assigned state, and the primary a
// synchronous standby. A data node whose pg_autoctl ended otherwise than
// by Kill fails t at once. It returns the primary's replication settings.
func (f *Formation) RequireHealthy(t testing.TB, timeout time.Duration) Sync {
	t.Helper()
	began := time.Now()
	var restarted []string
	for _, n := range f.Nodes {
		select {
		case <-n.done:
		default:
			continue // running
		}
		if !n.killed {
			t.Fatalf("pgha: %s's pg_autoctl has exited, not by Kill: the formation is broken\n%s", n.Name, tailLines(n.logs.String(), 40))
		}
		if err := f.run(n); err != nil {
			t.Fatal(err)
		}
		restarted = append(restarted, n.Name)
	}
	var s Sync
	err := f.wait("every node healthy and a synchronous standby", timeout, func(ctx context.Context) error {
		if _, err := f.settled(ctx); err != nil {
			return err
		}
		var err error
		s, err = f.synchronousNow(ctx)
		return err
	})
	if restarted != nil {
		t.Logf("pgha: ran %s again, crashed by Kill", strings.Join(restarted, ", "))
	}
	if err != nil {
		t.Fatalf("%v (a test that used this formation before may have left it broken)", err)
	}
	if restarted != nil {
		t.Logf("pgha: the formation whole again after %v", time.Since(began).Round(time.Millisecond))
	}
	return s
}

// Failover runs `pg_autoctl perform failover` and, while it runs, waits
// for another node than the old primary to take writes. It returns the
// new primary, how long after the command began it took writes, and how
// long the command took: it returns once the old primary is back as a
// standby. If no other node takes writes within 2 minutes, it fails t,
// having stopped the command rather than left it running into the next
// test on the formation (whose RequireHealthy waits out what the monitor
// does next).
//
// With one standby, pg_auto_failover 2.0 can lose committed transactions
// here: node_active reads the reporting node's row before it takes the
// group's lock, so a report of the primary that waited on the lock held
// by perform_failover sees the primary as "primary" still, and the
// standby already assigned prepare_promotion; it assigns the primary
// wait_primary ("none of the standby nodes in the quorum are healthy"),
// overwriting draining. The keeper then clears
// synchronous_standby_names and the old primary goes on committing,
// asynchronously, on the connections it has, until the monitor demotes
// it after primaryDemoteTimeout; pg_rewind discards those commits when it
// rejoins. With two standbys (number_sync_standbys = 1) the same report
// leaves the goal alone and synchronous replication on.
func (f *Formation) Failover(t testing.TB) (primary *Node, writable, command time.Duration) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	old, err := f.Primary(ctx)
	if err != nil {
		t.Fatalf("before the failover: %v", err)
	}
	type result struct {
		out  string
		err  error
		took time.Duration
	}
	began := time.Now()
	done := make(chan result, 1)
	go func() {
		out, err := f.Autoctl(ctx, "perform", "failover", "--pgdata", f.Monitor.PGData, "--formation", "default")
		done <- result{out, err, time.Since(began)}
	}()
	primary, writable, err = f.waitNewPrimary(old, began, 2*time.Minute)
	if err != nil {
		cancel()
		r := <-done
		t.Fatalf("%v\npg_autoctl perform failover, stopped: %v\n%s", err, r.err, r.out)
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("pg_autoctl perform failover: %v\n%s", r.err, r.out)
	}
	return primary, writable, r.took
}

// Kill crashes n: SIGKILL to its pg_autoctl process group (pg_autoctl,
// its services, the postmaster and every backend at once). n stays down
// until RequireHealthy runs it again.
func (f *Formation) Kill(n *Node) {
	if n.cmd == nil {
		return
	}
	n.killed = true
	syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
	<-n.done
	killPostmaster(n.PGData)
}

// WaitNewPrimary waits until a node other than old takes writes (not in
// recovery, not read-only) and the monitor has it as primary or
// wait_primary; it returns that node and the time since since.
func (f *Formation) WaitNewPrimary(t testing.TB, old *Node, since time.Time, timeout time.Duration) (*Node, time.Duration) {
	t.Helper()
	p, took, err := f.waitNewPrimary(old, since, timeout)
	if err != nil {
		t.Fatal(err)
	}
	return p, took
}

func (f *Formation) waitNewPrimary(old *Node, since time.Time, timeout time.Duration) (*Node, time.Duration, error) {
	var p *Node
	err := f.wait("a new primary", timeout, func(ctx context.Context) error {
		states, err := f.States(ctx)
		if err != nil {
			return err
		}
		for _, n := range f.Nodes {
			if st := states[n.Name]; n == old || (st != "primary/primary" && st != "wait_primary/wait_primary") {
				continue
			}
			if err := f.writable(ctx, n); err != nil {
				return err
			}
			p = n
			return nil
		}
		return fmt.Errorf("states %v", states)
	})
	return p, time.Since(since), err
}

// Events returns the monitor's last events, for a failure message or a
// report.
func (f *Formation) Events(n int) string {
	out, err := f.Autoctl(context.Background(), "show", "events", "--pgdata", f.Monitor.PGData, "--formation", "default", "--count", strconv.Itoa(n))
	if err != nil {
		return fmt.Sprintf("show events: %v\n%s", err, out)
	}
	return out
}

func (f *Formation) command(args ...string) *exec.Cmd {
	cmd := exec.Command(f.autoctl, args...)
	cmd.Env = f.env
	cmd.Dir = f.dir
	// Its own process group, so that Kill and the teardown reach every
	// process it starts; SIGINT (pg_autoctl's fast stop) if the test
	// process dies first.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: f.cred, Setpgid: true, Pdeathsig: syscall.SIGINT}
	return cmd
}

// must runs a pg_autoctl command to its end and returns an error, with
// the command's last lines of output, if it fails.
func (f *Formation) must(what string, args ...string) error {
	if out, err := f.Autoctl(context.Background(), args...); err != nil {
		return fmt.Errorf("pg_autoctl %s: %v\n%s", what, err, tailLines(out, 60))
	}
	return nil
}

// run starts `pg_autoctl run` for n in the background.
func (f *Formation) run(n *Node) error {
	cmd := f.command("run", "--pgdata", n.PGData)
	cmd.Stdout, cmd.Stderr = n.logs, n.logs
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pg_autoctl run %s: %v", n.Name, err)
	}
	n.cmd, n.done, n.killed = cmd, make(chan struct{}), false
	go func() { _ = cmd.Wait(); close(n.done) }() // reaps it; n.done says it ended
	return nil
}

// appendConf adds settings to n's postgresql.conf (kept as the file's
// owner has it).
func (f *Formation) appendConf(n *Node, settings []string) error {
	fh, err := os.OpenFile(filepath.Join(n.PGData, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer fh.Close()
	_, err = fh.WriteString("\n# pgha: test settings\n" + strings.Join(settings, "\n") + "\n")
	return err
}

func (f *Formation) connect(ctx context.Context, n *Node, db string) (*pgx.Conn, error) {
	return pgx.Connect(ctx, f.NodeURL(n, db))
}

func (f *Formation) query(ctx context.Context, n *Node, db, sql string) error {
	conn, err := f.connect(ctx, n, db)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, sql)
	return err
}

// writable returns nil when n is a primary that takes writes.
func (f *Formation) writable(ctx context.Context, n *Node) error {
	conn, err := f.connect(ctx, n, "postgres")
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	var recovery bool
	var readOnly string
	if err := conn.QueryRow(ctx, `SELECT pg_is_in_recovery(), current_setting('default_transaction_read_only')`).Scan(&recovery, &readOnly); err != nil {
		return err
	}
	if recovery || readOnly != "off" {
		return fmt.Errorf("in recovery %v, default_transaction_read_only %s", recovery, readOnly)
	}
	return nil
}

// wait polls check every 100 ms, each call bounded by 5 s, until it
// returns nil, and returns its last error after timeout.
func (f *Formation) wait(what string, timeout time.Duration, check func(context.Context) error) error {
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := check(ctx)
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("pg_auto_failover: waited %v for %s: %v", timeout, what, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
