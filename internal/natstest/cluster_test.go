package natstest

import (
	"net"
	"strconv"
	"testing"
)

// TestClusterProcessesMoveOffATakenPort: a port that freePorts found free
// is taken by another listener before nats-server binds it (as a busy
// machine's other sockets can); the server moves to new ports, the
// cluster forms, and JetStream answers.
func TestClusterProcessesMoveOffATakenPort(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: starts a NATS cluster (the full suite runs it)")
	}
	bin := RequireServerBinary(t)
	c := newCluster(t, 3)
	c.binary = bin
	c.procs = make([]*process, 3)
	t.Cleanup(func() {
		for i := range c.procs {
			c.Stop(i)
		}
	})
	taken := c.opts[1].Port
	l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(taken))
	if err != nil {
		t.Fatalf("taking port %d: %v", taken, err)
	}
	defer l.Close()
	for i := range 3 {
		c.start(i)
	}
	c.waitMetaLeader()
	if c.opts[1].Port == taken {
		t.Fatalf("server 1 is still on port %d, which another listener holds", taken)
	}
	if !c.jetStreamAnswers() {
		t.Fatal("the cluster does not answer JetStream requests")
	}
}
