package ordersapp

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/natstest"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/testwait"
)

// TestEventsStreamLeaderKilledMidStorm, on a 3-node JetStream cluster with
// stream ORDERS at 3 replicas: two instances on one PostgreSQL database
// take a storm of retried orders, each key sent twice, once to each
// instance; the server leading the stream is killed (SIGKILL) a quarter
// of the way into the events and started again after the storm, as an
// operator would. The relays' publishes fail until the
// two survivors elect a new leader, and then go through it: every order
// has exactly one event in the stream (no message id twice) and one
// receipt, and the audit is clean.
//
// It is judged by what it ends with, not by when: the orders do not wait
// for NATS (the outbox holds their events), and every wait is generous,
// so it runs beside the package's other parallel tests.
//
// It runs on the nats-server binary an operator runs (Debian's, here). On
// the server the tests link, a CI run under load found the restarted
// cluster answering the audit "JetStream system temporarily unavailable"
// for longer than the audit waits, so that variant is not run. A server
// before 2.11 may store a message
// twice across the leader change: a new leader could answer publishes
// before it had applied everything its predecessor stored, so its
// duplicate window missed those ids (nats-server pull requests 6485 and
// 6486, in 2.11). CI saw it with 2.9.10: every event published during the
// election was stored twice. On such a server the test allows repeated
// message ids in the stream, and still wants one event per order in the
// outbox, every order's message in the stream, one receipt per order and
// a clean audit (the consumer applies a repeat once); from 2.11 on it
// wants no repeat.
func TestEventsStreamLeaderKilledMidStorm(t *testing.T) {
	skipInShort(t, "runs a cluster of nats-server processes and a storm of orders")
	t.Parallel()
	streamLeaderKilledMidStorm(t, natstest.StartClusterProcesses(t, 3, natstest.RequireServerBinary(t)))
}

func streamLeaderKilledMidStorm(t *testing.T, cl *natstest.Cluster) {
	js := cl.JetStream(t)
	db := pgtest.Database(t)
	var (
		dataDir string
		bases   []string
	)
	for range 2 {
		c := replicaConfig(t, cl.URLs(), 3)
		c.DatabaseURL = db
		// Each order waits 50 ms at the gateway, so that the storm
		// (600 requests, 16 at a time) lasts about 2 s at least and the
		// kill falls inside it however fast the machine is.
		c.gatewayLatency = 50 * time.Millisecond
		dataDir = c.DataDir
		bases = append(bases, startInProcess(t, c).base)
	}
	testwait.Until(t, 30*time.Second, "stream ORDERS with 3 replicas", func() bool { return streamReplicas(js) == 3 })
	leaderOf := func() int {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		i, err := cl.StreamLeader(ctx, js, eventStream)
		if err != nil {
			t.Fatal(err)
		}
		return i
	}

	const n = 300
	type stormResult struct {
		bad   int64
		first []string
	}
	done := make(chan stormResult, 1)
	go func() {
		bad, first := stormOrders(bases, "stream-leader", n, 2)
		done <- stormResult{bad, first}
	}()
	testwait.Until(t, 60*time.Second, "a quarter of the events in the stream", func() bool { return streamMsgs(t, js) >= n/4 })
	victim := leaderOf()
	at := streamMsgs(t, js)
	cl.Stop(victim)
	t.Logf("killed n%d, the leader of stream %s, with %d of %d events in it", victim+1, eventStream, at, n)
	if at >= n {
		t.Fatalf("every event was in the stream before the kill: the relays were not publishing when the leader died")
	}
	r := <-done
	for _, f := range r.first {
		t.Error(f)
	}
	if r.bad > 0 {
		t.Fatalf("%d of %d copies did not get 201", r.bad, 2*n)
	}

	cl.Restart(victim)
	t.Logf("n%d started again; n%d leads the stream", victim+1, leaderOf()+1)
	testwait.Until(t, 60*time.Second, "every event in the stream", func() bool {
		leaderOf()
		return streamMsgs(t, js) >= n
	})
	waitConsumed(t, js, 60*time.Second)
	ordersBin, _ := binaries(t)
	out := auditOut(t, ordersBin, "--data-dir", dataDir, "--database-url", db, "--nats-url", cl.URLs())
	major, minor, err := cl.ServerVersion()
	if err != nil {
		t.Fatal(err)
	}
	repeats := 0
	if major < 2 || (major == 2 && minor < 11) {
		var msgs, distinct int
		if _, err := fmt.Sscanf(auditLine(out, "stream ORDERS:"), "%d messages, %d distinct", &msgs, &distinct); err != nil {
			t.Fatalf("audit's stream line %q: %v", auditLine(out, "stream ORDERS:"), err)
		}
		if repeats = msgs - distinct; repeats > 0 {
			t.Logf("nats-server %d.%d stored %d of the %d events twice across the leader change (fixed in 2.11); each was applied once", major, minor, repeats, n)
		}
	}
	wantEventAudit(t, out, n, repeats)
}
