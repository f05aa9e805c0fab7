package ordersapp

import (
	"context"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/internal/natstest"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/testwait"
)

// consumerLeader returns the index in cl of the server leading the
// durable consumer "receipts".
func consumerLeader(t *testing.T, cl *natstest.Cluster, js jetstream.JetStream) int {
	t.Helper()
	var leader int
	testwait.Until(t, 20*time.Second, "the consumer receipts to have a leader", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		cons, err := js.Consumer(ctx, eventStream, receiptsDurable)
		if err != nil {
			return false
		}
		info, err := cons.Info(ctx)
		if err != nil || info.Cluster == nil {
			return false
		}
		leader = cl.Index(info.Cluster.Leader)
		return leader >= 0
	})
	return leader
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// stepDownConsumer asks the leader of the consumer "receipts" to hand its
// leadership to another server.
func stepDownConsumer(t *testing.T, js jetstream.JetStream) {
	t.Helper()
	nc := js.Conn()
	msg, err := nc.Request("$JS.API.CONSUMER.LEADER.STEPDOWN."+eventStream+"."+receiptsDurable, nil, 5*time.Second)
	if err != nil {
		t.Fatalf("consumer step-down: %v", err)
	}
	if strings.Contains(string(msg.Data), `"error"`) {
		t.Fatalf("consumer step-down: %s", msg.Data)
	}
	time.Sleep(500 * time.Millisecond) // let the new leader's election settle before asking who it is (consumerLeader polls after this)
}

// metricValue reads one unlabelled metric from the text at url.
func metricValue(t *testing.T, url, name string) (float64, bool) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` (\S+)$`).FindSubmatch(raw)
	if m == nil {
		return 0, false
	}
	v, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatalf("%s %q: %v", name, m[1], err)
	}
	return v, true
}

// TestReceiptsAfterConsumerLeaderKilled, on a 3-node JetStream cluster with
// stream ORDERS at 3 replicas: the server leading the consumer "receipts"
// is killed under a storm of retried orders; the consumer goes on within
// a few heartbeats (it pulls again after two missed ones) instead of the
// client's default 30 s, every order has one event and one receipt, and
// the backlog metric falls back to 0.
func TestReceiptsAfterConsumerLeaderKilled(t *testing.T) {
	// The stopped server is started again before the audit, as an
	// operator would: with one server of three down, a JetStream request
	// may find no responder while the meta leader is elected again
	// (nats-server 2.15), and nats-server 2.9 refuses the audit's ordered
	// consumer for about a minute.
	t.Run("in-process", func(t *testing.T) { receiptsAfterLeaderKilled(t, natstest.StartCluster(t, 3)) })
	t.Run("nats-server-processes", func(t *testing.T) {
		receiptsAfterLeaderKilled(t, natstest.StartClusterProcesses(t, 3, natstest.RequireServerBinary(t)))
	})
}

func receiptsAfterLeaderKilled(t *testing.T, cl *natstest.Cluster) {
	js := cl.JetStream(t)
	// serve reaches the cluster through n1 (it learns the others from
	// it): the server killed below is never the one it is connected to,
	// whose loss would make it reconnect and pull again at once.
	c := replicaConfig(t, cl.URL(0), 3)
	srv := startInProcess(t, c)
	bases := []string{srv.base}

	const half = 60
	eventStorm(t, bases, "leader-a", half, 2)
	testwait.Until(t, 30*time.Second, "the first half's events", func() bool { return streamMsgs(t, js) == half })
	waitConsumed(t, js, 30*time.Second)
	if v, ok := metricValue(t, srv.base+"/metrics", "orders_receipts_pending"); !ok || v != 0 {
		t.Fatalf("orders_receipts_pending %v (exported %v) once caught up, want 0", v, ok)
	}

	victim := consumerLeader(t, cl, js)
	for tries := 0; victim == 0; tries++ {
		if tries == 10 {
			t.Fatal("the consumer's leadership stays on n1")
		}
		stepDownConsumer(t, js)
		victim = consumerLeader(t, cl, js)
	}
	cl.Stop(victim)
	t.Logf("stopped n%d, the leader of consumer %s", victim+1, receiptsDurable)
	be := openBE(t, c.DataDir, "")

	// One order after the leader's death. Its receipt waits for a new
	// leader of the consumer: the surviving servers elect one after a
	// raft election timeout drawn between 4s and 9s (nats-server's
	// defaults), which is the server's and not the client's. What the
	// client adds is the stall from the later of the event's arrival and
	// the new leader's election to the receipt: two missed heartbeats
	// (2s) and a pull, where the client's defaults would wait until their
	// own heartbeat timer (30s) ran out.
	eventStorm(t, bases, "leader-b", 1, 1)
	testwait.Until(t, 30*time.Second, "the order's event", func() bool { return streamMsgs(t, js) == half+1 })
	published := time.Now()
	var leader int
	testwait.Until(t, 30*time.Second, "a new leader of the consumer", func() bool {
		leader = consumerLeader(t, cl, js)
		return leader != victim
	})
	elected := time.Now()
	testwait.Until(t, 60*time.Second, "the order's receipt", func() bool { return countReceipts(t, be) == half+1 })
	received := time.Now()
	stall := received.Sub(later(published, elected))
	t.Logf("n%d leads the consumer %v after the event was in the stream; the receipt came %v after that (%v after the event)",
		leader+1, elected.Sub(published).Round(time.Millisecond), stall.Round(time.Millisecond), received.Sub(published).Round(time.Millisecond))
	// A bound with room for a loaded machine. With the client's defaults
	// this is up to 30s, by where its heartbeat timer stood.
	if stall > 6*time.Second {
		t.Errorf("the receipt came %v after the consumer had a new leader: the consumer stalled after its leader died", stall)
	}

	eventStorm(t, bases, "leader-c", half-1, 2)
	testwait.Until(t, 60*time.Second, "every receipt", func() bool { return countReceipts(t, be) == 2*half })
	waitConsumed(t, js, 30*time.Second)
	if v, ok := metricValue(t, srv.base+"/metrics", "orders_receipts_pending"); !ok || v != 0 {
		t.Errorf("orders_receipts_pending %v (exported %v) after catching up, want 0", v, ok)
	}
	cl.Restart(victim)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := cl.StreamLeader(ctx, js, eventStream); err != nil {
		t.Fatal(err)
	}
	ordersBin, _ := binaries(t)
	out := auditOut(t, ordersBin, "--data-dir", c.DataDir, "--nats-url", cl.URLs())
	wantEventAudit(t, out, 2*half, 0)
}

// TestSeveralConsumersShareReceipts: serve without its consumer and three
// `orders consume` processes on one PostgreSQL database and one NATS:
// each applies part of the events (they share the durable consumer), and
// every order has exactly one receipt; the audit is clean.
func TestSeveralConsumersShareReceipts(t *testing.T) {
	db := pgtest.Database(t)
	nats := testNATS(t)
	ordersBin, _ := binaries(t)
	dir := t.TempDir()
	addr := freeAddr(t)
	start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", dir, "--database-url", db,
		"--jwt-secret", testSecret, "--nats-url", nats, "--consume=false")
	var consumers []*consumeProc
	for range 3 {
		consumers = append(consumers, startConsume(t, ordersBin, "--data-dir", dir, "--database-url", db, "--nats-url", nats))
	}
	js := natsJS(t, nats)
	const n = 300
	eventStorm(t, []string{"http://" + addr}, "shared", n, 2)
	testwait.Until(t, 30*time.Second, "every event in the stream", func() bool { return streamMsgs(t, js) == n })
	waitConsumed(t, js, 60*time.Second)

	applied := regexp.MustCompile(`orders consume: stopped; (\d+) events applied by this process`)
	total := 0
	for i, p := range consumers {
		logs := p.stop(t)
		m := applied.FindStringSubmatch(logs)
		if m == nil {
			t.Fatalf("consumer %d: no last line:\n%s", i, tail(logs, 10))
		}
		k, _ := strconv.Atoi(m[1])
		if k == 0 {
			t.Errorf("consumer %d applied nothing: the three do not share the work", i)
		}
		total += k
		t.Logf("consumer %d applied %d", i, k)
	}
	if total < n {
		t.Errorf("the consumers applied %d events in all, want at least %d", total, n)
	}
	if got := countRows(t, db, `SELECT count(*) FROM receipts`); got != n {
		t.Errorf("%d receipts for %d orders", got, n)
	}
	if dup := countRows(t, db, `SELECT count(*) FROM (SELECT order_id FROM receipts GROUP BY order_id HAVING count(*) > 1) d`); dup != 0 {
		t.Errorf("%d orders with more than one receipt", dup)
	}
	out := auditOut(t, ordersBin, "--data-dir", dir, "--database-url", db, "--nats-url", nats)
	wantEventAudit(t, out, n, 0)
}
