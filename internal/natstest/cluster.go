// Package natstest runs a JetStream cluster of NATS servers inside a test
// process, on loopback: the cluster the tests of replicated streams, of a
// fleet sharing one NATS and of a stream leader that dies need. Each server
// keeps its files in a directory of the test's, so that one that is stopped
// can be started again with its streams.
package natstest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
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
	procs   []*exec.Cmd      // its processes; nil where stopped
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
	c.procs = make([]*exec.Cmd, n)
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
	routes := make([]string, n)
	for i := range n {
		routes[i] = "nats://127.0.0.1:" + strconv.Itoa(ports[n+i])
	}
	c := &Cluster{t: t}
	for i := range n {
		c.opts = append(c.opts, &server.Options{
			ServerName: fmt.Sprintf("n%d", i+1),
			Host:       "127.0.0.1",
			Port:       ports[i],
			JetStream:  true,
			StoreDir:   t.TempDir(),
			Cluster:    server.ClusterOpts{Name: "natstest", Host: "127.0.0.1", Port: ports[n+i]},
			Routes:     server.RoutesFromStr(strings.Join(routes, ",")),
			NoSigs:     true,
			NoLog:      true,
		})
	}
	return c
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
// it accepts clients.
func (c *Cluster) startProcess(i int) {
	c.t.Helper()
	o := c.opts[i]
	var routes []string
	for _, r := range o.Routes {
		routes = append(routes, r.String())
	}
	cmd := exec.Command(c.binary, "-a", o.Host, "-p", strconv.Itoa(o.Port), "-n", o.ServerName,
		"-js", "-sd", o.StoreDir, "--cluster_name", o.Cluster.Name,
		"--cluster", "nats://"+o.Cluster.Host+":"+strconv.Itoa(o.Cluster.Port), "--routes", strings.Join(routes, ","))
	dieWithTest(cmd)
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("natstest: starting %s: %v", c.binary, err)
	}
	c.procs[i] = cmd
	deadline := time.Now().Add(readyTimeout)
	for {
		conn, err := net.DialTimeout("tcp", net.JoinHostPort(o.Host, strconv.Itoa(o.Port)), time.Second)
		if err == nil {
			conn.Close()
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("natstest: server %d (%s) does not accept clients after %v", i, c.binary, readyTimeout)
		}
		time.Sleep(50 * time.Millisecond) // a poll with a deadline
	}
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
			_ = p.Process.Kill()
			_ = p.Wait() // killed: its exit status is the kill's
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
