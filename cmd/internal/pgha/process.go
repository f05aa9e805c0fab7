package pgha

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// teardown stops everything Launch started and removes its directory.
func (f *Formation) teardown() error {
	nodes := append(append([]*Node{}, f.Nodes...), f.Monitor)
	var wg sync.WaitGroup
	for _, n := range nodes {
		if n == nil {
			continue
		}
		wg.Add(1)
		go func() { defer wg.Done(); n.stop(20 * time.Second) }()
	}
	wg.Wait()
	for _, n := range nodes {
		if n != nil {
			killPostmaster(n.PGData)
		}
	}
	killLeftovers(f.dir)
	for _, n := range nodes {
		if n != nil {
			removeStaleSocket(n)
		}
	}
	if err := os.RemoveAll(f.dir); err != nil {
		return fmt.Errorf("removing %s: %v", f.dir, err)
	}
	return nil
}

// stop asks pg_autoctl to stop (SIGINT: a fast shutdown of its postgres),
// waits up to grace, then kills whatever is left in its process group.
func (n *Node) stop(grace time.Duration) {
	if n.cmd == nil {
		return
	}
	select {
	case <-n.done:
	default:
		syscall.Kill(n.cmd.Process.Pid, syscall.SIGINT)
		select {
		case <-n.done:
		case <-time.After(grace):
		}
	}
	syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
	select {
	case <-n.done:
	case <-time.After(10 * time.Second):
	}
}

// killPostmaster kills the postmaster that postmaster.pid in pgdata names,
// if it is alive and runs on pgdata.
func killPostmaster(pgdata string) {
	b, err := os.ReadFile(filepath.Join(pgdata, "postmaster.pid"))
	if err != nil {
		return
	}
	pid, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(b), "\n", 2)[0]))
	if err != nil || pid <= 1 {
		return
	}
	if cmdline(pid) != "" && strings.Contains(cmdline(pid), pgdata) {
		syscall.Kill(pid, syscall.SIGKILL)
		waitGone(pid)
	}
}

// killLeftovers kills every process whose command line names a path
// under dir (a postmaster or pg_autoctl of this formation that escaped
// its process group); their backends exit when their postmaster is gone.
func killLeftovers(dir string) {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		if strings.Contains(cmdline(pid), dir+string(filepath.Separator)) {
			syscall.Kill(pid, syscall.SIGKILL)
			waitGone(pid)
		}
	}
}

func cmdline(pid int) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return strings.ReplaceAll(string(b), "\x00", " ")
}

func waitGone(pid int) {
	for i := 0; i < 100 && syscall.Kill(pid, 0) == nil; i++ {
		if st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); bytes.Contains(st, []byte(") Z ")) {
			return // a zombie, its parent reaps it
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// removeStaleSocket removes the Unix socket and lock file that a killed
// postmaster of n left in the system's socket directory, when the lock
// file names n's data directory and its process is gone.
func removeStaleSocket(n *Node) {
	for _, d := range []string{"/var/run/postgresql", "/tmp"} {
		sock := filepath.Join(d, fmt.Sprintf(".s.PGSQL.%d", n.Port))
		b, err := os.ReadFile(sock + ".lock")
		if err != nil {
			continue
		}
		lines := strings.Split(string(b), "\n")
		if len(lines) < 2 || strings.TrimSpace(lines[1]) != n.PGData {
			continue
		}
		if pid, err := strconv.Atoi(strings.TrimSpace(lines[0])); err == nil && syscall.Kill(pid, 0) == nil {
			continue
		}
		os.Remove(sock)
		os.Remove(sock + ".lock")
	}
}

// tools finds pg_autoctl and the bin directory of a PostgreSQL server
// that has the pgautofailover extension (the newest, if several).
func tools() (autoctl, pgBin string, err error) {
	autoctl, err = exec.LookPath("pg_autoctl")
	if err != nil {
		cands, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pg_autoctl")
		cands = append([]string{"/usr/bin/pg_autoctl"}, cands...)
		for _, c := range cands {
			if _, e := os.Stat(c); e == nil {
				autoctl, err = c, nil
				break
			}
		}
		if err != nil {
			return "", "", errors.New("pg_autoctl not found")
		}
	}
	controls, _ := filepath.Glob("/usr/share/postgresql/*/extension/pgautofailover.control")
	var versions []int
	for _, c := range controls {
		v, err := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(c))))
		if err != nil {
			continue
		}
		if _, err := os.Stat(fmt.Sprintf("/usr/lib/postgresql/%d/bin/pg_ctl", v)); err == nil {
			versions = append(versions, v)
		}
	}
	if len(versions) == 0 {
		return "", "", errors.New("no PostgreSQL server with the pgautofailover extension under /usr/lib/postgresql")
	}
	sort.Ints(versions)
	return autoctl, fmt.Sprintf("/usr/lib/postgresql/%d/bin", versions[len(versions)-1]), nil
}

// credential returns how to run as the postgres OS user: a credential to
// switch to when the test runs as root, nil when it runs as postgres.
func credential() (cred *syscall.Credential, uid, gid int, err error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, 0, 0, fmt.Errorf("no postgres OS user: %w", err)
	}
	uid, _ = strconv.Atoi(u.Uid)
	gid, _ = strconv.Atoi(u.Gid)
	switch os.Geteuid() {
	case 0:
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, uid, gid, nil
	case uid:
		return nil, uid, gid, nil
	default:
		return nil, 0, 0, fmt.Errorf("the test runs as uid %d: run it as root or as the postgres user", os.Geteuid())
	}
}

// freePorts returns n distinct loopback ports that were free a moment ago.
func freePorts(n int) ([]int, error) {
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	var ports []int
	for i := 0; i < n; i++ {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		lns = append(lns, ln)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = append([]string{fmt.Sprintf("… %d lines before", len(lines)-n)}, lines[len(lines)-n:]...)
	}
	return strings.Join(lines, "\n")
}

// logBuffer is a bytes.Buffer that a process writes while the test reads.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
