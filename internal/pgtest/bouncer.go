package pgtest

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	osexec "os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Bouncer is a PgBouncer of a test's own in transaction pooling mode
// (pool_mode = transaction: a client gets a server connection for one
// transaction, or one statement outside a transaction), in front of the
// server TEST_DATABASE_URL names, on a free port of 127.0.0.1, trust
// authentication. Every database of the server is reachable through it by
// name.
type Bouncer struct {
	Port int
	// LogFile is PgBouncer's log (removed when the test ends).
	LogFile string
	admin   string // the server's URL
}

// URL returns the address of database db (for "": the one
// TEST_DATABASE_URL names) through the bouncer, as TEST_DATABASE_URL's
// user, for a client that keeps every other setting at its default (pgx's
// default query mode included).
func (b *Bouncer) URL(db string) string {
	u, err := url.Parse(b.admin)
	if err != nil {
		panic(err)
	}
	u.Host = net.JoinHostPort("127.0.0.1", strconv.Itoa(b.Port))
	if db != "" {
		u.Path = "/" + db
	}
	return u.String()
}

// NewBouncer starts a PgBouncer for t and stops it when t ends. It needs
// Debian's pgbouncer and root (PgBouncer refuses to run as root: it is
// started with -u postgres): without them it skips t, except under
// CI=true, where it fails.
func NewBouncer(t testing.TB) *Bouncer {
	t.Helper()
	admin := URL(t)
	unable := func(why string) {
		t.Helper()
		if os.Getenv("CI") == "true" {
			t.Fatalf("PgBouncer is needed under CI: %s", why)
		}
		t.Skipf("PgBouncer tests skipped: %s (they run as root with Debian's pgbouncer, and under CI=true)", why)
	}
	bin, err := osexec.LookPath("pgbouncer")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/pgbouncer"); serr != nil {
			unable("pgbouncer not found (Debian's package pgbouncer)")
		}
		bin = "/usr/sbin/pgbouncer"
	}
	if os.Geteuid() != 0 {
		unable("not running as root")
	}
	server, err := url.Parse(admin)
	if err != nil {
		t.Fatal(err)
	}
	host, port := server.Hostname(), server.Port()
	if port == "" {
		port = "5432"
	}
	user := server.User.Username()
	if user == "" {
		user = "root"
	}

	// The files must be readable by the postgres user PgBouncer runs as.
	dir, err := os.MkdirTemp("", "pgbouncer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &Bouncer{Port: ln.Addr().(*net.TCPAddr).Port, LogFile: filepath.Join(dir, "pgbouncer.log"), admin: admin}
	ln.Close()
	// default_pool_size: tests hold transactions open while they claim
	// on another connection; a pool as small as the server's share of
	// them would make them wait on each other.
	ini := fmt.Sprintf(`[databases]
* = host=%s port=%s
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 40
logfile = %s
`, host, port, b.Port, filepath.Join(dir, "users.txt"), b.LogFile)
	for name, content := range map[string]string{
		"pgbouncer.ini": ini,
		"users.txt":     fmt.Sprintf("%q \"\"\n", user),
		"pgbouncer.log": "",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o666); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(filepath.Join(dir, name), 0o666); err != nil {
			t.Fatal(err)
		}
	}
	cmd := osexec.Command(bin, "-u", "postgres", filepath.Join(dir, "pgbouncer.ini"))
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting pgbouncer: %v", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		if err := <-exited; err == nil {
			t.Logf("pgbouncer exited before it was stopped")
		}
	})
	deadline := time.Now().Add(15 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn, err := pgx.Connect(ctx, b.URL(""))
		if err == nil {
			conn.Close(ctx)
			cancel()
			return b
		}
		cancel()
		select {
		case err := <-exited:
			log, _ := os.ReadFile(b.LogFile)
			t.Fatalf("pgbouncer exited (%v); its log:\n%s", err, log)
		default:
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(b.LogFile)
			t.Fatalf("pgbouncer on port %d does not answer: %v; its log:\n%s", b.Port, err, log)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
