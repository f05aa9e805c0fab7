package ordersapp

// Helpers of the order events' fault suite (faults_events_test.go): the
// NATS servers the cases run (a nats-server child process to kill -9 and
// restart, an in-process server whose client connections the test can
// cut), a snapshot of the outbox, stream ORDERS and the receipts, and the
// durable consumer's counts.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/outbox"
)

// natsServerBin is Debian's nats-server, the one .ci/run starts.
const natsServerBin = "/usr/sbin/nats-server"

// natsChild is a nats-server child process with JetStream on a fixed
// port of 127.0.0.1 and a store dir of the test's: killed with SIGKILL
// and started again on the same port and dir, it comes back with its
// streams, messages and consumers (what it had written out).
type natsChild struct {
	port int
	dir  string
	url  string
	cmd  *exec.Cmd
	logs *syncBuffer
	runs int
}

// newNATSChild starts a nats-server child for t and kills it when t
// ends. Without the binary it skips t, except under CI=true.
func newNATSChild(t *testing.T) *natsChild {
	t.Helper()
	if _, err := os.Stat(natsServerBin); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s is needed under CI: %v", natsServerBin, err)
		}
		t.Skipf("%s not installed (Debian's nats-server): %v", natsServerBin, err)
	}
	_, port, err := net.SplitHostPort(freeAddr(t))
	if err != nil {
		t.Fatal(err)
	}
	p := &natsChild{dir: t.TempDir(), logs: new(syncBuffer)}
	p.port, _ = strconv.Atoi(port)
	p.url = fmt.Sprintf("nats://127.0.0.1:%d", p.port)
	t.Cleanup(func() {
		p.kill()
		if t.Failed() {
			t.Logf("nats-server logs:\n%s", tail(p.logs.String(), 40))
		}
	})
	if err := p.start(); err != nil {
		t.Fatal(err)
	}
	return p
}

// start starts the server and waits (bounded) until JetStream answers. It
// returns an error rather than failing t: the restarts run beside the
// test's goroutine.
func (p *natsChild) start() error {
	p.runs++
	fmt.Fprintf(p.logs, "--- start %d\n", p.runs)
	cmd := exec.Command(natsServerBin, "-a", "127.0.0.1", "-p", strconv.Itoa(p.port), "-js", "-sd", p.dir)
	cmd.Stdout, cmd.Stderr = p.logs, p.logs
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", natsServerBin, err)
	}
	p.cmd = cmd
	deadline := time.Now().Add(20 * time.Second)
	for {
		err := jetStreamAnswers(p.url)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("nats-server on %s: JetStream does not answer after 20s: %w", p.url, err)
		}
		time.Sleep(20 * time.Millisecond) // a poll with a deadline: ends as soon as the server answers
	}
}

// jetStreamAnswers connects to url once and asks for the account's
// JetStream info.
func jetStreamAnswers(url string) error {
	nc, err := nats.Connect(url, nats.Timeout(time.Second), nats.NoReconnect())
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = js.AccountInfo(ctx)
	return err
}

// kill ends the server with SIGKILL, as a crash would, and reaps it.
func (p *natsChild) kill() {
	if p.cmd == nil || p.cmd.ProcessState != nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	_ = p.cmd.Wait()
}

// inProcNATS starts a NATS server with JetStream in the test process and
// returns it with its URL; t's end shuts it down. Unlike testNATS it
// gives the test the server, to list and cut client connections.
func inProcNATS(t *testing.T) (*natsserver.Server, string) {
	t.Helper()
	ns, err := natsserver.NewServer(&natsserver.Options{Host: "127.0.0.1", Port: natsserver.RANDOM_PORT, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		ns.Shutdown()
		t.Fatal("in-process NATS not ready after 10s")
	}
	t.Cleanup(func() { ns.Shutdown(); ns.WaitForShutdown() })
	return ns, ns.ClientURL()
}

// cutClients closes, on the server's side, every client connection named
// name, and waits until the server lists none. It returns how many it
// closed.
func cutClients(t *testing.T, ns *natsserver.Server, name string) int {
	t.Helper()
	named := func() []uint64 {
		cz, err := ns.Connz(&natsserver.ConnzOptions{Limit: 1024})
		if err != nil {
			t.Fatal(err)
		}
		var ids []uint64
		for _, c := range cz.Conns {
			if c.Name == name {
				ids = append(ids, c.Cid)
			}
		}
		return ids
	}
	ids := named()
	for _, id := range ids {
		if err := ns.DisconnectClientByID(id); err != nil {
			t.Fatalf("closing client %d (%s): %v", id, name, err)
		}
	}
	testwait.Until(t, 10*time.Second, "the server to drop the clients named "+name, func() bool { return len(named()) == 0 })
	return len(ids)
}

// openBE opens the orders database the way the commands do, for the
// test's own reads; closed when t ends.
func openBE(t *testing.T, dir, db string) *backend {
	t.Helper()
	be, err := openBackend(context.Background(), &Config{DataDir: dir, DatabaseURL: db})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.close() })
	return be
}

// evSnap is what the outbox, stream ORDERS and the receipts held at one
// time (read in that order).
type evSnap struct {
	events    int
	unsent    map[string]bool // event id → unsent
	orders    map[string]bool // order ids
	streamIDs map[string]int  // Nats-Msg-Id → messages with it
	msgs      int             // messages of stream ORDERS
	receipts  map[string]int  // order id → receipts
	nReceipts int
}

// snapshot reads be's orders, outbox and receipts and js's stream ORDERS.
func snapshot(t *testing.T, be *backend, js jetstream.JetStream) evSnap {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := evSnap{unsent: map[string]bool{}, orders: map[string]bool{}, streamIDs: map[string]int{}, receipts: map[string]int{}}
	if err := be.allOrders(ctx, func(o orders.Order) error { s.orders[o.ID] = true; return nil }); err != nil {
		t.Fatalf("reading the orders: %v", err)
	}
	err := be.outbox.Each(ctx, func(e outbox.Event, sentAt time.Time) error {
		s.events++
		if sentAt.IsZero() {
			s.unsent[e.ID] = true
		}
		return nil
	})
	if err != nil {
		t.Fatalf("reading the outbox: %v", err)
	}
	msgs, _, _, err := readStream(ctx, js, new(atomic.Int64))
	if err != nil {
		t.Fatalf("reading stream %s: %v", eventStream, err)
	}
	for _, m := range msgs {
		s.msgs++
		s.streamIDs[m.id]++
	}
	if err := be.allReceipts(ctx, func(r orders.Receipt) error { s.receipts[r.OrderID]++; s.nReceipts++; return nil }); err != nil {
		t.Fatalf("reading the receipts: %v", err)
	}
	return s
}

// publishedUnsent counts the unsent events that stream ORDERS holds: the
// relay published them and has not marked them sent.
func (s evSnap) publishedUnsent() int {
	n := 0
	for id := range s.unsent {
		if s.streamIDs[id] > 0 {
			n++
		}
	}
	return n
}

// repeats counts the message ids that stream ORDERS holds more than once,
// and the messages past the first of each.
func (s evSnap) repeats() (ids, extra int) {
	for _, n := range s.streamIDs {
		if n > 1 {
			ids++
			extra += n - 1
		}
	}
	return ids, extra
}

// wantOnce checks what every case ends with: n orders, each with exactly
// one distinct orders.created message id in stream ORDERS and exactly
// one receipt; no message or receipt without its order; nothing unsent;
// and repeatIDs ids held twice (published again past the duplicate
// window), none more often.
func (s evSnap) wantOnce(t *testing.T, n, repeatIDs int) {
	t.Helper()
	if len(s.orders) != n {
		t.Errorf("%d orders, want %d", len(s.orders), n)
	}
	if len(s.unsent) != 0 {
		t.Errorf("%d events unsent", len(s.unsent))
	}
	var bad []string
	for id := range s.orders {
		if m := s.streamIDs[orders.EventID(id)]; m < 1 || m > 2 {
			bad = append(bad, fmt.Sprintf("%s: %d messages", id, m))
		}
		if r := s.receipts[id]; r != 1 {
			bad = append(bad, fmt.Sprintf("%s: %d receipts", id, r))
		}
	}
	for mid := range s.streamIDs {
		if !s.orders[orderOfEvent(mid)] {
			bad = append(bad, "message id "+mid+" without its order")
		}
	}
	for oid, r := range s.receipts {
		if !s.orders[oid] {
			bad = append(bad, fmt.Sprintf("%d receipts for %s, no such order", r, oid))
		}
	}
	sort.Strings(bad)
	if len(bad) > 0 {
		t.Errorf("%d problems: %s", len(bad), strings.Join(bad[:min(len(bad), 20)], "; "))
	}
	if ids, extra := s.repeats(); ids != repeatIDs || extra != repeatIDs {
		t.Errorf("stream %s: %d ids repeated (%d extra messages), want %d once each", eventStream, ids, extra, repeatIDs)
	}
	if len(s.streamIDs) != n || s.nReceipts != n {
		t.Errorf("%d distinct message ids and %d receipts for %d orders", len(s.streamIDs), s.nReceipts, n)
	}
}

// countReceipts counts the receipts.
func countReceipts(t *testing.T, be *backend) int {
	t.Helper()
	n := 0
	if err := be.allReceipts(context.Background(), func(orders.Receipt) error { n++; return nil }); err != nil {
		t.Fatalf("reading the receipts: %v", err)
	}
	return n
}

// consumerInfo returns the durable consumer receipts' info.
func consumerInfo(t *testing.T, js jetstream.JetStream) *jetstream.ConsumerInfo {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cons, err := js.Consumer(ctx, eventStream, receiptsDurable)
	if err != nil {
		t.Fatalf("consumer %s: %v", receiptsDurable, err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		t.Fatalf("consumer %s: %v", receiptsDurable, err)
	}
	return info
}

// acked is how many messages the consumer has had acknowledged, as long
// as none was delivered twice: its deliveries less those pending.
func acked(info *jetstream.ConsumerInfo) int {
	return int(info.Delivered.Consumer) - info.NumAckPending
}

// setAckWait changes the durable consumer's AckWait (a test's shortcut:
// the services set it from the key lease, at least 30s, when they start
// consuming).
func setAckWait(t *testing.T, js jetstream.JetStream, d time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cfg := consumerInfo(t, js).Config
	cfg.AckWait = d
	if _, err := js.UpdateConsumer(ctx, eventStream, cfg); err != nil {
		t.Fatalf("setting AckWait %v on consumer %s: %v", d, receiptsDurable, err)
	}
}

// waitRedelivery waits until the durable consumer redelivers: the test
// fetches one message and, once it is a redelivery, gives it back (Nak:
// at once, to whoever consumes next). It returns the delivery count of
// the message it saw.
func waitRedelivery(t *testing.T, js jetstream.JetStream) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cons, err := js.Consumer(ctx, eventStream, receiptsDurable)
	if err != nil {
		t.Fatal(err)
	}
	var delivered uint64
	testwait.Until(t, 30*time.Second, "consumer "+receiptsDurable+" to redeliver", func() bool {
		batch, err := cons.Fetch(1, jetstream.FetchMaxWait(500*time.Millisecond))
		if err != nil {
			t.Fatalf("fetch: %v", err)
		}
		got := false
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				t.Fatal(err)
			}
			if err := m.Nak(); err != nil {
				t.Fatalf("nak: %v", err)
			}
			if md.NumDelivered > 1 {
				delivered, got = md.NumDelivered, true
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("fetch: %v", err)
		}
		return got
	})
	return delivered
}

// consumeApplied reads the count of `orders consume`'s last line.
var consumeApplied = regexp.MustCompile(`orders consume: stopped; (\d+) events applied by this process`)

// stoppedApplied stops p (SIGINT) and returns how many events it applied
// (its receipt function ran to its end).
func stoppedApplied(t *testing.T, p *consumeProc) int {
	t.Helper()
	out := p.stop(t)
	m := consumeApplied.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("orders consume's last line missing:\n%s", tail(out, 20))
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// killConsume ends an `orders consume` with SIGKILL and reaps it.
func killConsume(p *consumeProc) {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	_ = p.cmd.Wait()
}

// waitCaughtUp waits until every event is marked sent, stream ORDERS
// holds n distinct ids (plus the repeats), the consumer has nothing
// waiting or unacknowledged, and n receipts exist.
func waitCaughtUp(t *testing.T, be *backend, js jetstream.JetStream, n int, timeout time.Duration) {
	t.Helper()
	ctx := context.Background()
	testwait.Until(t, timeout, "the relay to mark every event sent", func() bool {
		u, err := be.outbox.Unsent(ctx)
		return err == nil && u == 0
	})
	waitConsumed(t, js, timeout)
	testwait.Until(t, timeout, fmt.Sprintf("%d receipts", n), func() bool { return countReceipts(t, be) >= n })
}
