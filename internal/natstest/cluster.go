// Package natstest runs a JetStream cluster of NATS servers inside a test
// process, on loopback: the cluster the tests of replicated streams, of a
// fleet sharing one NATS and of a stream leader that dies need. Each server
// keeps its files in a directory of the test's, so that one that is stopped
// can be started again with its streams.
package natstest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// readyTimeout bounds the wait for a server to accept clients, and for the
// cluster to elect its JetStream meta leader.
const readyTimeout = 20 * time.Second

// Cluster is a JetStream cluster of NATS servers on loopback: in the test
// process (StartCluster), or processes of a nats-server binary
// (StartClusterProcesses).
type Cluster struct {
	t       testing.TB
	opts    []*server.Options
	servers []*server.Server // in process; nil where stopped
	binary  string           // nats-server, for a cluster of processes
	procs   []*process       // its processes; nil where stopped
}

// process is one nats-server process of a Cluster.
type process struct {
	cmd    *exec.Cmd
	out    *outputBuffer // its stdout and stderr
	exited chan struct{} // closed once it has exited and been reaped
}

// outputBuffer is a process's output, safe to read while it writes.
type outputBuffer struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (o *outputBuffer) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.Write(p)
}

func (o *outputBuffer) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.String()
}

// ServerBinary returns the nats-server binary on PATH, or "" when there is
// none.
func ServerBinary() string {
	p, err := exec.LookPath("nats-server")
	if err != nil {
		return ""
	}
	return p
}

// RequireServerBinary returns the nats-server binary on PATH for a test of
// a cluster of processes. Without one it skips t, except under CI=true,
// where .ci/run installs nats-server and it fails t.
func RequireServerBinary(t testing.TB) string {
	t.Helper()
	bin := ServerBinary()
	if bin == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("no nats-server binary on PATH under CI")
		}
		t.Skip("no nats-server binary on PATH")
	}
	return bin
}

// ServerVersion returns the major and minor version of the cluster's
// servers: the binary's (`nats-server --version`) for a cluster of
// processes, else the linked server's (server.VERSION).
func (c *Cluster) ServerVersion() (major, minor int, err error) {
	v := server.VERSION
	if c.binary != "" {
		out, err := exec.Command(c.binary, "--version").Output()
		if err != nil {
			return 0, 0, fmt.Errorf("natstest: %s --version: %w", c.binary, err)
		}
		// "nats-server: v2.9.10"
		v = strings.TrimSpace(string(out))
		v = v[strings.LastIndex(v, " ")+1:]
	}
	parts := strings.SplitN(strings.TrimPrefix(v, "v"), ".", 3)
	if len(parts) < 2 {
		return 0, 0, fmt.Errorf("natstest: version %q: want vMAJOR.MINOR", v)
	}
	if major, err = strconv.Atoi(parts[0]); err == nil {
		minor, err = strconv.Atoi(parts[1])
	}
	if err != nil {
		return 0, 0, fmt.Errorf("natstest: version %q: %w", v, err)
	}
	return major, minor, nil
}

// StartClusterProcesses starts n clustered JetStream servers as processes
// of the nats-server binary bin (the version an operator runs, which may
// be older than the one the tests link), on 127.0.0.1, and returns once
// the cluster answers JetStream requests. Stop kills a process (SIGKILL,
// as a crash would).
func StartClusterProcesses(t testing.TB, n int, bin string) *Cluster {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: starts a NATS cluster (the full suite runs it)")
	}
	c := newCluster(t, n)
	c.binary = bin
	c.procs = make([]*process, n)
	t.Cleanup(func() {
		for i := range c.procs {
			c.Stop(i)
		}
	})
	for i := range n {
		c.start(i)
	}
	c.waitMetaLeader()
	return c
}

// StartCluster starts n clustered JetStream servers on 127.0.0.1 and
// returns once they accept clients and agree on a meta leader. They are
// shut down when t ends.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: starts a NATS cluster (the full suite runs it)")
	}
	c := newCluster(t, n)
	c.servers = make([]*server.Server, n)
	t.Cleanup(func() {
		for i := range c.servers {
			c.Stop(i)
		}
	})
	for i := range n {
		c.start(i)
	}
	c.waitMetaLeader()
	return c
}

// newCluster picks the ports and directories of n servers.
func newCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	if n < 1 {
		t.Fatalf("natstest: a cluster of %d servers", n)
	}
	ports := freePorts(t, 2*n)
	c := &Cluster{t: t}
	for i := range n {
		c.opts = append(c.opts, &server.Options{
			ServerName: fmt.Sprintf("n%d", i+1),
			Host:       "127.0.0.1",
			Port:       ports[i],
			JetStream:  true,
			StoreDir:   t.TempDir(),
			Cluster:    server.ClusterOpts{Name: "natstest", Host: "127.0.0.1", Port: ports[n+i]},
			NoSigs:     true,
			NoLog:      true,
		})
	}
	c.setRoutes()
	return c
}

// setRoutes gives every server a route to each server's cluster port.
func (c *Cluster) setRoutes() {
	routes := make([]string, len(c.opts))
	for i, o := range c.opts {
		routes[i] = "nats://127.0.0.1:" + strconv.Itoa(o.Cluster.Port)
	}
	for _, o := range c.opts {
		o.Routes = server.RoutesFromStr(strings.Join(routes, ","))
	}
}

// freePorts returns n distinct ports that were free on 127.0.0.1 a moment
// ago.
func freePorts(t testing.TB, n int) []int {
	t.Helper()
	var ls []net.Listener
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("natstest: a free port: %v", err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	for _, l := range ls {
		l.Close()
	}
	return ports
}

func (c *Cluster) start(i int) {
	c.t.Helper()
	if c.binary != "" {
		c.startProcess(i)
		return
	}
	ns, err := server.NewServer(c.opts[i])
	if err != nil {
		c.t.Fatalf("natstest: server %d: %v", i, err)
	}
	ns.Start()
	if !ns.ReadyForConnections(readyTimeout) {
		ns.Shutdown()
		c.t.Fatalf("natstest: server %d does not accept clients after %v", i, readyTimeout)
	}
	c.servers[i] = ns
}

// startProcess starts server i as a process of c.binary and waits until
// it accepts clients. freePorts' ports were free a moment before; on a
// busy machine another socket (an outgoing connection's local port, say)
// can take one before nats-server binds it, and the process exits saying
// "address already in use": server i then moves to two new ports (the
// others learn its route from it, as a cluster's servers gossip their
// routes) and starts again, up to three times.
func (c *Cluster) startProcess(i int) {
	c.t.Helper()
	for attempt := 1; ; attempt++ {
		p, up := c.launch(i)
		if up {
			c.procs[i] = p
			return
		}
		out := p.out.String()
		if attempt < 3 && strings.Contains(out, "address already in use") {
			c.t.Logf("natstest: server %d could not bind its ports, moving it: %s", i, lastLine(out))
			c.movePorts(i)
			continue
		}
		c.t.Fatalf("natstest: server %d (%s) does not accept clients (after %v, or it exited); its output:\n%s", i, c.binary, readyTimeout, out)
	}
}

// launch starts server i's process and reports whether it accepts clients
// within readyTimeout; when it does not, the process is gone.
func (c *Cluster) launch(i int) (p *process, up bool) {
	c.t.Helper()
	o := c.opts[i]
	var routes []string
	for _, r := range o.Routes {
		routes = append(routes, r.String())
	}
	cmd := exec.Command(c.binary, "-a", o.Host, "-p", strconv.Itoa(o.Port), "-n", o.ServerName,
		"-js", "-sd", o.StoreDir, "--cluster_name", o.Cluster.Name,
		"--cluster", "nats://"+o.Cluster.Host+":"+strconv.Itoa(o.Cluster.Port), "--routes", strings.Join(routes, ","))
	p = &process{cmd: cmd, out: new(outputBuffer), exited: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.out, p.out
	dieWithTest(cmd)
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("natstest: starting %s: %v", c.binary, err)
	}
	go func() {
		_ = cmd.Wait() // its exit status is in its output, or the kill's
		close(p.exited)
	}()
	deadline := time.Now().Add(readyTimeout)
	for {
		if natsAnswers(net.JoinHostPort(o.Host, strconv.Itoa(o.Port))) {
			return p, true
		}
		select {
		case <-p.exited:
			return p, false
		case <-time.After(50 * time.Millisecond): // a poll with a deadline
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			<-p.exited
			return p, false
		}
	}
}

// natsAnswers reports whether a NATS server answers at addr: it greets a
// new client with INFO at once. Another program's listener on the port
// does not.
func natsAnswers(addr string) bool {
	conn, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return false
	}
	defer conn.Close()
	if err := conn.SetReadDeadline(time.Now().Add(time.Second)); err != nil {
		return false
	}
	greeting := make([]byte, 4)
	_, err = io.ReadFull(conn, greeting)
	return err == nil && string(greeting) == "INFO"
}

// movePorts gives server i two new ports, and every server's route list
// its new cluster port.
func (c *Cluster) movePorts(i int) {
	c.t.Helper()
	ports := freePorts(c.t, 2)
	c.opts[i].Port, c.opts[i].Cluster.Port = ports[0], ports[1]
	c.setRoutes()
}

// lastLine is the last non-empty line of s.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// waitMetaLeader waits until a running server is the JetStream meta
// leader and every running server knows it (for processes: until the
// cluster answers a JetStream request).
func (c *Cluster) waitMetaLeader() {
	c.t.Helper()
	deadline := time.Now().Add(readyTimeout)
	if c.binary != "" {
		for {
			if c.jetStreamAnswers() {
				return
			}
			if time.Now().After(deadline) {
				c.t.Fatalf("natstest: no JetStream meta leader after %v", readyTimeout)
			}
			time.Sleep(100 * time.Millisecond) // a poll with a deadline
		}
	}
	for {
		leader, current := false, true
		for _, ns := range c.servers {
			if ns == nil {
				continue
			}
			leader = leader || ns.JetStreamIsLeader()
			current = current && ns.JetStreamIsCurrent()
		}
		if leader && current {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("natstest: no JetStream meta leader after %v", readyTimeout)
		}
		time.Sleep(50 * time.Millisecond) // a poll with a deadline
	}
}

// jetStreamAnswers reports whether the cluster answers a JetStream
// account request (it has a meta leader).
func (c *Cluster) jetStreamAnswers() bool {
	nc, err := nats.Connect(c.URLs(), nats.Timeout(time.Second))
	if err != nil {
		return false
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err = js.AccountInfo(ctx)
	return err == nil
}

// Size is the number of servers, running or stopped.
func (c *Cluster) Size() int { return len(c.opts) }

// URL is the client URL of server i.
func (c *Cluster) URL(i int) string {
	return "nats://127.0.0.1:" + strconv.Itoa(c.opts[i].Port)
}

// URLs is every server's client URL, comma-separated: a --nats-url that
// reaches the cluster while any of its servers is up.
func (c *Cluster) URLs() string {
	us := make([]string, len(c.opts))
	for i := range c.opts {
		us[i] = c.URL(i)
	}
	return strings.Join(us, ",")
}

// Stop shuts server i down, or kills its process (a no-op when it is
// stopped): its clients
// reconnect to the others, and the streams it led elect a new leader.
func (c *Cluster) Stop(i int) {
	if c.binary != "" {
		if p := c.procs[i]; p != nil {
			_ = p.cmd.Process.Kill()
			<-p.exited
			c.procs[i] = nil
		}
		return
	}
	if ns := c.servers[i]; ns != nil {
		ns.Shutdown()
		ns.WaitForShutdown()
		c.servers[i] = nil
	}
}

// Restart starts server i again on its ports and files.
func (c *Cluster) Restart(i int) {
	c.t.Helper()
	if (c.binary == "" && c.servers[i] != nil) || (c.binary != "" && c.procs[i] != nil) {
		return
	}
	c.start(i)
	c.waitMetaLeader()
}

// Index returns the index of the server named name ("n1"…), or -1.
func (c *Cluster) Index(name string) int {
	for i, o := range c.opts {
		if o.ServerName == name {
			return i
		}
	}
	return -1
}

// JetStream connects to the cluster (any server) for the test's own look
// at streams; the connection is closed when t ends.
func (c *Cluster) JetStream(t testing.TB) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(c.URLs(), nats.Timeout(5*time.Second), nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatalf("natstest: connecting to the cluster: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// StreamLeader returns the index of the server that leads stream name,
// waiting (up to ctx) until it has one.
func (c *Cluster) StreamLeader(ctx context.Context, js jetstream.JetStream, name string) (int, error) {
	last := errors.New("no leader yet")
	for {
		st, err := js.Stream(ctx, name)
		if err != nil {
			last = err
		} else if ci := st.CachedInfo().Cluster; ci != nil && ci.Leader != "" {
			if i := c.Index(ci.Leader); i >= 0 {
				return i, nil
			}
		}
		select {
		case <-ctx.Done():
			return -1, fmt.Errorf("natstest: stream %s has no leader: %w (last: %v)", name, ctx.Err(), last)
		case <-time.After(100 * time.Millisecond): // a poll bounded by ctx
		}
	}
}
