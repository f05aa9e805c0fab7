package ordersapp

// The order events' fault suite (issue 14, point 5), on real processes:
// `orders serve` (its outbox relay), `orders consume` (the receipts
// consumer), NATS with JetStream (in this process, or a nats-server child
// process to kill -9), a fault proxy (cmd/internal/faultproxy) between a
// process and NATS, and PostgreSQL or SQLite. Each case proves that its
// fault happened (counted at the kill), then lets the chain recover, and
// ends with `orders audit` exit 0 and, read from the outbox, stream
// ORDERS and the receipts table, exactly one distinct orders.created
// message id and exactly one receipt per order (evSnap.wantOnce).
//
// The durable consumer's AckWait is 30s or more (the key lease plus 10s):
// the cases that need a redelivery sooner set it shorter on the server
// with their own client (setAckWait), which only brings the redelivery
// forward.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/cmd/internal/faultproxy"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/outbox"
)

// relayKill is the state after relayKilled: serve was killed with
// SIGKILL while stream ORDERS held events whose outbox rows were unsent.
type relayKill struct {
	n                int
	dir, db, natsURL string
	be               *backend
	js               jetstream.JetStream
	consumer         *consumeProc
	atKill           evSnap
	unsent, pubUns   int // unsent events at the kill; of them, already in the stream
}

// relayKilled runs `orders serve` (--consume=false) on db (PostgreSQL,
// or SQLite when empty) to an in-process NATS through a fault proxy, and
// `orders consume` straight to NATS. The proxy holds serve's traffic
// while n orders are created (the relay cannot start: their events wait
// in the outbox), then lets it through with the server → client direction
// 250ms late: each PubAck comes late, and a relay pass holds the events
// it published unmarked until its end. Once the stream holds at least 3
// events whose rows are unsent, serve is killed with SIGKILL. It fails t
// when no published event was left unsent at the kill.
func relayKilled(t *testing.T, prefix, db string, n int) *relayKill {
	t.Helper()
	ordersBin, _ := binaries(t)
	r := &relayKill{n: n, dir: t.TempDir(), db: db, natsURL: testNATS(t)}
	px := faultproxy.New(t, prefix+"-nats", faultHostPort(t, r.natsURL))
	px.Partition()
	addr := freeAddr(t)
	serve := start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", r.dir, "--database-url", r.db,
		"--jwt-secret", testSecret, "--nats-url", px.URL(r.natsURL), "--consume=false")
	r.consumer = startConsume(t, ordersBin, "--data-dir", r.dir, "--database-url", r.db, "--nats-url", r.natsURL)
	r.js = natsJS(t, r.natsURL)
	r.be = openBE(t, r.dir, r.db)
	// On SQLite a relay pass holds the write lock while it publishes:
	// orders created meanwhile would wait for it. They are created first.
	eventStorm(t, []string{"http://" + addr}, prefix, n, 2)
	if u, err := r.be.outbox.Unsent(context.Background()); err != nil || u != n || streamMsgs(t, r.js) != 0 {
		t.Fatalf("before NATS answers serve: %d events unsent (%v), %d in the stream; want %d and 0", u, err, streamMsgs(t, r.js), n)
	}
	if _, err := px.Latency(faultproxy.Downstream, 250*time.Millisecond, 0); err != nil {
		t.Fatal(err)
	}
	px.Heal()
	ctx := context.Background()
	testwait.Until(t, 30*time.Second, "the stream to hold 3 events the relay has not marked sent", func() bool {
		// The stream first, then the outbox: the difference is a lower
		// bound of the published-unsent events at the second read.
		msgs := streamMsgs(t, r.js)
		sent := 0
		err := r.be.outbox.Each(ctx, func(_ outbox.Event, sentAt time.Time) error {
			if !sentAt.IsZero() {
				sent++
			}
			return nil
		})
		return err == nil && int(msgs)-sent >= 3
	})
	serve.kill()
	// The pass's transaction ends with the connection: what it had not
	// committed stays unsent. PubAcks still in the proxy go nowhere.
	r.atKill = snapshot(t, r.be, r.js)
	r.unsent, r.pubUns = len(r.atKill.unsent), r.atKill.publishedUnsent()
	if r.pubUns == 0 {
		t.Fatalf("kill -9 of serve missed the window: of %d unsent events none is in the stream (%d messages)", r.unsent, r.atKill.msgs)
	}
	if ids, _ := r.atKill.repeats(); ids != 0 || r.atKill.msgs != len(r.atKill.streamIDs) {
		t.Fatalf("at the kill the stream holds %d messages for %d ids", r.atKill.msgs, len(r.atKill.streamIDs))
	}
	t.Logf("kill -9 of serve: %d orders, %d events unsent, %d of them already in stream %s (%d messages)",
		len(r.atKill.orders), r.unsent, r.pubUns, eventStream, r.atKill.msgs)
	return r
}

// restartServe starts `orders serve` again on the same database, straight
// to NATS, and returns its base URL.
func (r *relayKill) restartServe(t *testing.T) string {
	t.Helper()
	ordersBin, _ := binaries(t)
	addr := freeAddr(t)
	start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", r.dir, "--database-url", r.db,
		"--jwt-secret", testSecret, "--nats-url", r.natsURL, "--consume=false")
	return "http://" + addr
}

// TestFaultEventsRelayKilledBeforeMark: kill -9 of the relay between
// publish and marking sent. The events it had published stay unsent; the
// restarted serve publishes every unsent event again with the same
// Nats-Msg-Id, JetStream drops the repeats within its duplicate window,
// and the stream holds one message per order. On PostgreSQL and SQLite.
func TestFaultEventsRelayKilledBeforeMark(t *testing.T) {
	t.Run("postgres", func(t *testing.T) { relayKilledBeforeMark(t, pgtest.Database(t)) })
	t.Run("sqlite", func(t *testing.T) { relayKilledBeforeMark(t, "") })
}

func relayKilledBeforeMark(t *testing.T, db string) {
	const n = 40
	r := relayKilled(t, "relaykill", db, n)
	base := r.restartServe(t)
	waitCaughtUp(t, r.be, r.js, n, 30*time.Second)

	// The new relay published (and marked) exactly the events unsent at
	// the kill, those already in the stream among them.
	if got := faultMetric(t, base, "orders_events_published_total"); got != int64(r.unsent) {
		t.Errorf("the restarted relay published %d events, want the %d unsent at the kill", got, r.unsent)
	}
	s := snapshot(t, r.be, r.js)
	s.wantOnce(t, n, 0)
	if s.msgs != n {
		t.Errorf("stream %s holds %d messages for %d orders: JetStream kept a repeat within the duplicate window", eventStream, s.msgs, n)
	}
	applied := stoppedApplied(t, r.consumer)
	if applied != n {
		t.Errorf("orders consume applied %d events, want %d", applied, n)
	}
	out := auditOut(t, binPath(t), "--data-dir", r.dir, "--database-url", r.db, "--nats-url", r.natsURL)
	wantEventAudit(t, out, n, 0)
	t.Logf("published again after the restart: %d (%d of them repeats JetStream dropped); stream %d messages, %d distinct ids; receipts %d, %s; consumer applied %d",
		r.unsent, r.pubUns, s.msgs, len(s.streamIDs), s.nReceipts, auditLine(out, "receipts per order:"), applied)
}

// TestFaultEventsRelayDownPastWindow: a relay down longer than the
// duplicate window. As above, serve is killed with events published and
// unmarked, and the consumer applies them; then the stream's duplicate
// window is shrunk (to 100ms) and the test waits until JetStream has
// forgotten their ids (a probe id published after the shrink is stored
// again; the probe's messages are deleted). The restarted relay publishes
// them again: the stream holds two messages for each, and the consumer's
// own key store replays the second: one receipt per order; the audit
// counts the repeats and exits 0. On PostgreSQL and SQLite.
func TestFaultEventsRelayDownPastWindow(t *testing.T) {
	t.Run("postgres", func(t *testing.T) { relayDownPastWindow(t, pgtest.Database(t)) })
	t.Run("sqlite", func(t *testing.T) { relayDownPastWindow(t, "") })
}

func relayDownPastWindow(t *testing.T, db string) {
	const n = 40
	r := relayKilled(t, "pastwin", db, n)
	waitConsumed(t, r.js, 30*time.Second)
	applied1 := stoppedApplied(t, r.consumer)
	if applied1 != r.atKill.msgs {
		t.Errorf("orders consume applied %d events, want the %d in the stream at the kill", applied1, r.atKill.msgs)
	}

	forgetIDs(t, r.js)
	base := r.restartServe(t)
	ordersBin := binPath(t)
	consumer := startConsume(t, ordersBin, "--data-dir", r.dir, "--database-url", r.db, "--nats-url", r.natsURL)
	waitCaughtUp(t, r.be, r.js, n, 30*time.Second)
	testwait.Until(t, 30*time.Second, "the stream to hold the repeats", func() bool { return int(streamMsgs(t, r.js)) >= n+r.pubUns })
	waitConsumed(t, r.js, 30*time.Second)

	if got := faultMetric(t, base, "orders_events_published_total"); got != int64(r.unsent) {
		t.Errorf("the restarted relay published %d events, want the %d unsent at the kill", got, r.unsent)
	}
	s := snapshot(t, r.be, r.js)
	s.wantOnce(t, n, r.pubUns)
	applied2 := stoppedApplied(t, consumer)
	// The events unpublished at the kill are applied now; the repeats
	// are replays (the function does not run).
	if applied2 != n-r.atKill.msgs {
		t.Errorf("the second orders consume applied %d events, want %d (the repeats replayed, not applied)", applied2, n-r.atKill.msgs)
	}
	out := auditOut(t, ordersBin, "--data-dir", r.dir, "--database-url", r.db, "--nats-url", r.natsURL)
	wantEventAudit(t, out, n, r.pubUns)
	ids, extra := s.repeats()
	t.Logf("repeated message ids in the stream: %d (%d extra messages) for %d events published and unmarked at the kill; receipts %d (%s); consumers applied %d then %d; audit: %s",
		ids, extra, r.pubUns, s.nReceipts, auditLine(out, "receipts per order:"), applied1, applied2, auditLine(out, "stream ORDERS:"))
}

// forgetIDs shrinks stream ORDERS' duplicate window to 100ms and waits
// until JetStream has dropped every id stored before: a probe id,
// published after the shrink, is stored again (ids leave the window in
// the order they came). The probe's messages are deleted from the stream.
// The restarted serve sets the window back (EnsureStream).
func forgetIDs(t *testing.T, js jetstream.JetStream) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, eventStream)
	if err != nil {
		t.Fatal(err)
	}
	shrinkDuplicateWindow(ctx, t, js, st.CachedInfo().Config)
	probe := nats.NewMsg(eventSubject)
	probe.Data = []byte(`{"probe":true}`)
	probe.Header.Set(jetstream.MsgIDHeader, fmt.Sprintf("probe-%d", time.Now().UnixNano()))
	var seqs []uint64
	testwait.Until(t, 20*time.Second, "a probe id to leave the duplicate window", func() bool {
		ack, err := js.PublishMsg(ctx, probe)
		if err != nil {
			t.Fatalf("publishing the probe: %v", err)
		}
		if !ack.Duplicate {
			seqs = append(seqs, ack.Sequence)
		}
		return len(seqs) == 2
	})
	for _, seq := range seqs {
		if err := st.DeleteMsg(ctx, seq); err != nil {
			t.Fatalf("deleting probe message %d: %v", seq, err)
		}
	}
}

// TestFaultEventsConsumerKilledBeforeAck: kill -9 of the consumer between
// the commit of a receipt and its ack. `orders consume` (SQLite) reaches
// NATS through a fault proxy whose server → client direction is 100ms
// late; once receipts exist the proxy is partitioned (the consumer's next
// acks are held), and once a receipt has committed whose ack the server
// has not got, the consumer is killed with SIGKILL and the server drops its
// connection (the held acks go nowhere). The restarted consumer gets the
// unacknowledged messages again: idem.Do replays the applied ones, one
// receipt per order.
func TestFaultEventsConsumerKilledBeforeAck(t *testing.T) {
	const n = 40
	ordersBin := binPath(t)
	ns, natsURL := inProcNATS(t)
	dir := t.TempDir()
	addr := freeAddr(t)
	start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", dir, "--jwt-secret", testSecret,
		"--nats-url", natsURL, "--consume=false")
	js := natsJS(t, natsURL)
	be := openBE(t, dir, "")
	eventStorm(t, []string{"http://" + addr}, "ackkill", n, 2)
	testwait.Until(t, 30*time.Second, "the relay to publish every event", func() bool { return streamMsgs(t, js) == n })

	px := faultproxy.New(t, "ackkill-nats", faultHostPort(t, natsURL))
	// Deliveries and the answers to acks 100ms late: the consumer takes
	// a tenth of a second or more per message.
	if _, err := px.Latency(faultproxy.Downstream, 100*time.Millisecond, 0); err != nil {
		t.Fatal(err)
	}
	first := startConsume(t, ordersBin, "--data-dir", dir, "--nats-url", px.URL(natsURL), "--key-lease", "2s")
	testwait.Until(t, 30*time.Second, "5 receipts", func() bool { return countReceipts(t, be) >= 5 })
	// From now on the consumer's acks are held in the proxy. A receipt
	// committed after the partition began has its ack held, since the
	// consumer acknowledges only after the commit; counting reads where
	// receipts outnumber acks would not prove it (an ack sent just before
	// the partition may still be on its way). The consumer gets there with
	// a message it already holds, once the confirmation of its last ack
	// (held too, or late) comes or DoubleAck gives up.
	px.Partition()
	before := countReceipts(t, be)
	testwait.Until(t, 30*time.Second, "a receipt committed after the partition began", func() bool {
		return countReceipts(t, be) > before
	})
	killConsume(first)
	cut := cutClients(t, ns, "orders consume")
	// The partition is never healed: healing would hand the held ack to
	// the proxy's link to the server, which the server may still read.
	// cutClients returns once the server no longer lists the client, but
	// nats-server closes the socket afterwards, from the client's write
	// loop; an ack written in between was applied (a clean-clone run saw
	// 6 receipts and 6 acks at this point, twice). The proxy's cleanup
	// heals it once the test is over.

	// The consumer is gone and its connection closed: the counts are
	// final. No message was delivered twice yet (AckWait 30s).
	info := consumerInfo(t, js)
	at := snapshot(t, be, js)
	unacked := at.nReceipts - acked(info)
	if info.NumAckPending == 0 || at.nReceipts == 0 || unacked <= 0 {
		t.Fatalf("kill -9 of the consumer missed the window: %d receipts, %d messages acknowledged, %d pending", at.nReceipts, acked(info), info.NumAckPending)
	}
	t.Logf("kill -9 of orders consume (%d connection cut by the server): %d receipts, %d messages acknowledged, %d delivered and unacknowledged, of them %d with their receipt committed",
		cut, at.nReceipts, acked(info), info.NumAckPending, unacked)

	setAckWait(t, js, time.Second)
	redelivered := waitRedelivery(t, js)
	second := startConsume(t, ordersBin, "--data-dir", dir, "--nats-url", natsURL, "--key-lease", "2s")
	waitCaughtUp(t, be, js, n, 30*time.Second)
	end := consumerInfo(t, js)
	s := snapshot(t, be, js)
	s.wantOnce(t, n, 0)
	applied := stoppedApplied(t, second)
	if applied != n-at.nReceipts {
		t.Errorf("the restarted consumer applied %d events, want %d (the %d with a receipt replayed)", applied, n-at.nReceipts, at.nReceipts-acked(info))
	}
	if end.NumRedelivered == 0 && end.Delivered.Consumer <= info.Delivered.Consumer {
		t.Errorf("no redelivery seen: %+v", end.Delivered)
	}
	out := auditOut(t, ordersBin, "--data-dir", dir, "--nats-url", natsURL)
	wantEventAudit(t, out, n, 0)
	t.Logf("restart: redelivery seen (delivery %d of a message); the new consumer applied %d and replayed %d (redelivered with their receipt committed); deliveries %d for %d messages; receipts %d (%s)",
		redelivered, applied, info.NumAckPending-applied, end.Delivered.Consumer, n, s.nReceipts, auditLine(out, "receipts per order:"))
}

// natsOutage is one kill -9 and restart of nats-server during a storm.
type natsOutage struct {
	answeredAtKill, answeredAtStart int64 // final answers of the storm
	unsentAtStart                   int   // events waiting in the outbox when NATS came back
	down                            time.Duration
	err                             error
}

// TestFaultEventsNATSRestartMidStorm: NATS restarted twice during a storm
// (nats-server killed with SIGKILL, started again on its port and store
// dir). Two serve instances on PostgreSQL, each with its relay and
// consumer, 160 keys x 3 copies through the retrying client. Orders are
// answered while NATS is down (the outbox keeps their events), the relays
// and consumers reconnect and catch up; then the fault suite's checks
// (faultCheck: one order and one payment per key, audit clean) and one
// message id and one receipt per order.
func TestFaultEventsNATSRestartMidStorm(t *testing.T) {
	np := newNATSChild(t)
	_, paymentsBin := binaries(t)
	db := pgtest.Database(t)
	c := &chain{db: db, dir: t.TempDir(), natsURL: np.url}
	payAddr := freeAddr(t)
	c.payURL = "http://" + payAddr
	c.payments = start(t, c.payURL+"/v1/payment_intents", paymentsBin, "serve", "--addr", payAddr)
	for i := 0; i < 2; i++ {
		faultAddInstance(t, c, db, c.payURL, "--key-lease", "2s")
	}
	js := natsJS(t, np.url)
	testwait.Until(t, 30*time.Second, "consumer "+receiptsDurable, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := js.Consumer(ctx, eventStream, receiptsDurable)
		return err == nil
	})
	// An ack lost with the server would wait 30s for its redelivery.
	setAckWait(t, js, 3*time.Second)
	be := openBE(t, c.dir, db)

	s := faultNewStorm("natsrestart", 160, 3, 5)
	total := int64(s.keys * s.copies)
	done := make(chan struct{})
	outages := make(chan []natsOutage, 1)
	go func() {
		var outs []natsOutage
		defer func() { outages <- outs }()
		for i := 0; i < 2; i++ {
			var o natsOutage
			if !s.waitAnswered(total*int64(3*i+1)/8, done) {
				o.err = errors.New("the storm ended before the kill")
				outs = append(outs, o)
				return
			}
			np.kill()
			t0 := time.Now()
			o.answeredAtKill = s.answered.Load()
			// Down until a sixteenth of the answers more came and 20
			// events wait in the outbox (or the storm ended): orders go
			// on without NATS.
			running := s.waitAnswered(o.answeredAtKill+total/16, done)
			for {
				if u, err := be.outbox.Unsent(context.Background()); err == nil {
					o.unsentAtStart = u
				}
				if !running || o.unsentAtStart >= 20 {
					break
				}
				select {
				case <-done:
					running = false
				case <-time.After(2 * time.Millisecond): // a poll, bounded by the storm's end
				}
			}
			o.answeredAtStart = s.answered.Load()
			o.err = np.start()
			o.down = time.Since(t0)
			outs = append(outs, o)
			if o.err != nil {
				return
			}
		}
	}()
	s.run(c.bases, 16)
	close(done)
	outs := <-outages
	for i, o := range outs {
		t.Logf("outage %d: NATS down %v; %d answers before the kill, %d answered while NATS was down; %d events waiting in the outbox when it came back",
			i+1, o.down.Round(time.Millisecond), o.answeredAtKill, o.answeredAtStart-o.answeredAtKill, o.unsentAtStart)
		if o.err != nil {
			t.Fatalf("outage %d: %v", i+1, o.err)
		}
		if o.answeredAtStart == o.answeredAtKill || o.unsentAtStart < 20 {
			t.Errorf("outage %d: no order answered, or fewer than 20 events waiting, while NATS was down", i+1)
		}
	}
	if len(outs) != 2 {
		t.Fatalf("%d outages, want 2", len(outs))
	}

	t0 := time.Now()
	waitCaughtUp(t, be, js, s.keys, time.Minute)
	caughtUp := time.Since(t0)
	res := faultCheck(t, c, s)
	snap := snapshot(t, be, js)
	snap.wantOnce(t, s.keys, 0)
	info := consumerInfo(t, js)
	t.Logf("after 2 NATS restarts: relays and consumer caught up %v after the storm's last answer; %d orders, stream %s %d messages (%d distinct ids), %d receipts; consumer %s: %d deliveries for %d messages; relays published %d (%d passes failed), consumers applied %d; audit: %s",
		caughtUp.Round(time.Millisecond), res.orders, eventStream, snap.msgs, len(snap.streamIDs), snap.nReceipts, receiptsDurable, info.Delivered.Consumer, snap.msgs,
		faultSum(t, c.bases, "orders_events_published_total"), faultSum(t, c.bases, "orders_events_relay_errors_total"), faultSum(t, c.bases, "orders_receipts_handled_total"), auditLine(res.audit, "receipts per order:"))
	if ok := strings.Contains(res.audit, "OK: every invariant holds"); !ok {
		t.Errorf("audit not clean")
	}
}

// binPath returns the orders binary.
func binPath(t *testing.T) string {
	t.Helper()
	b, _ := binaries(t)
	return b
}
