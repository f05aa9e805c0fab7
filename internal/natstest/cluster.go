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

// Cluster is a JetStream cluster of servers running in the test process.
type Cluster struct {
	t       testing.TB
	opts    []*server.Options
	servers []*server.Server // nil where stopped
}

// StartCluster starts n clustered JetStream servers on 127.0.0.1 and
// returns once they accept clients and agree on a meta leader. They are
// shut down when t ends.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	if n < 1 {
		t.Fatalf("natstest: a cluster of %d servers", n)
	}
	ports := freePorts(t, 2*n)
	routes := make([]string, n)
	for i := range n {
		routes[i] = "nats://127.0.0.1:" + strconv.Itoa(ports[n+i])
	}
	c := &Cluster{t: t, servers: make([]*server.Server, n)}
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

// waitMetaLeader waits until a running server is the JetStream meta
// leader and every running server knows it.
func (c *Cluster) waitMetaLeader() {
	c.t.Helper()
	deadline := time.Now().Add(readyTimeout)
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

// Stop shuts server i down (a no-op when it is stopped): its clients
// reconnect to the others, and the streams it led elect a new leader.
func (c *Cluster) Stop(i int) {
	if ns := c.servers[i]; ns != nil {
		ns.Shutdown()
		ns.WaitForShutdown()
		c.servers[i] = nil
	}
}

// Restart starts server i again on its ports and files.
func (c *Cluster) Restart(i int) {
	c.t.Helper()
	if c.servers[i] != nil {
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
