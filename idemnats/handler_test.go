package idemnats_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemnats"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/sqlitestore"
)

const (
	testUser = "$consumer:test"
	testOp   = "test.apply"
)

// ledger is a store with a function whose writes go through the store's
// transaction: apply records the message's body, and applied counts the
// committed records per body. open returns another handle on the same
// store, as another process would have (memstore: the same one).
type ledger struct {
	store   idem.Store
	open    func(t *testing.T) idem.Store
	apply   idem.DoFunc
	applied func(t *testing.T) map[string]int
}

// forEachLedger runs f against each server (forEach) and, in subtests,
// each store.
func forEachLedger(t *testing.T, f func(t *testing.T, srv server, l *ledger)) {
	forEach(t, func(t *testing.T, srv server) {
		for _, c := range []struct {
			name string
			mk   func(t *testing.T) *ledger
		}{{"memstore", memLedger}, {"sqlitestore", sqliteLedger}} {
			t.Run(c.name, func(t *testing.T) { f(t, srv, c.mk(t)) })
		}
	})
}

func memLedger(t *testing.T) *ledger {
	st := memstore.New(memstore.Options{})
	var mu sync.Mutex
	counts := map[string]int{}
	return &ledger{
		store: st,
		open:  func(*testing.T) idem.Store { return st },
		apply: func(ctx context.Context, input []byte) ([]byte, error) {
			tx, err := memstore.FromContext(ctx)
			if err != nil {
				return nil, err
			}
			body := string(input)
			tx.OnCommit(func() {
				mu.Lock()
				defer mu.Unlock()
				counts[body]++
			})
			return []byte("ok " + body), nil
		},
		applied: func(*testing.T) map[string]int {
			mu.Lock()
			defer mu.Unlock()
			out := make(map[string]int, len(counts))
			for k, v := range counts {
				out[k] = v
			}
			return out
		},
	}
}

func sqliteLedger(t *testing.T) *ledger {
	path := filepath.Join(t.TempDir(), "idem.db")
	open := func(t *testing.T) idem.Store {
		t.Helper()
		st, err := sqlitestore.Open(context.Background(), path, sqlitestore.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = st.Close() })
		return st
	}
	st := open(t).(*sqlitestore.Store)
	if _, err := st.DB().ExecContext(t.Context(), `CREATE TABLE applied (body TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return &ledger{
		store: st,
		open:  open,
		apply: func(ctx context.Context, input []byte) ([]byte, error) {
			tx, err := sqlitestore.FromContext(ctx)
			if err != nil {
				return nil, err
			}
			if _, err := tx.ExecContext(ctx, `INSERT INTO applied (body) VALUES (?)`, string(input)); err != nil {
				return nil, err
			}
			return []byte("ok " + string(input)), nil
		},
		applied: func(t *testing.T) map[string]int {
			t.Helper()
			return sqlCounts(t, st.DB())
		},
	}
}

func sqlCounts(t *testing.T, db *sql.DB) map[string]int {
	t.Helper()
	rows, err := db.QueryContext(context.Background(), `SELECT body, count(*) FROM applied GROUP BY body`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var b string
		var n int
		if err := rows.Scan(&b, &n); err != nil {
			t.Fatal(err)
		}
		out[b] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// counted wraps fn, counting its calls per input.
type counted struct {
	mu    sync.Mutex
	calls map[string]int
}

func (c *counted) wrap(fn idem.DoFunc) idem.DoFunc {
	return func(ctx context.Context, input []byte) ([]byte, error) {
		c.mu.Lock()
		if c.calls == nil {
			c.calls = map[string]int{}
		}
		c.calls[string(input)]++
		c.mu.Unlock()
		return fn(ctx, input)
	}
}

func (c *counted) get(input string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[input]
}

// durable makes a durable pull consumer "c" on st.
func durable(t *testing.T, st jetstream.Stream, ackWait time.Duration) jetstream.Consumer {
	t.Helper()
	cons, err := st.CreateOrUpdateConsumer(t.Context(), jetstream.ConsumerConfig{
		Durable:   "c",
		AckPolicy: jetstream.AckExplicitPolicy,
		AckWait:   ackWait,
	})
	if err != nil {
		t.Fatal(err)
	}
	return cons
}

// consume runs h on cons until t ends.
func consume(t *testing.T, cons jetstream.Consumer, h jetstream.MessageHandler) {
	t.Helper()
	stop, err := idemnats.Consume(context.Background(), cons, h, jetstream.PullMaxMessages(10))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
}

// caughtUp reports whether cons has every message of its stream
// acknowledged (or terminated).
func caughtUp(t *testing.T, cons jetstream.Consumer) bool {
	t.Helper()
	info, err := cons.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.NumPending == 0 && info.NumAckPending == 0
}

// publishPastWindow publishes msg (with its Nats-Msg-Id) until the stream
// stores it, not taking it for a repeat: the id's earlier message has left
// the duplicate window.
func publishPastWindow(t *testing.T, js jetstream.JetStream, msg *nats.Msg) {
	t.Helper()
	testwait.Until(t, 0, "the duplicate window to pass for "+msg.Header.Get(jetstream.MsgIDHeader), func() bool {
		ack, err := js.PublishMsg(t.Context(), msg)
		if err != nil {
			t.Fatal(err)
		}
		return !ack.Duplicate
	})
}

func idMsg(subject, id, body string) *nats.Msg {
	m := nats.NewMsg(subject)
	m.Header.Set(jetstream.MsgIDHeader, id)
	m.Data = []byte(body)
	return m
}

func checkOnce(t *testing.T, l *ledger, bodies []string) {
	t.Helper()
	got := l.applied(t)
	for _, b := range bodies {
		if got[b] != 1 {
			t.Errorf("%s applied %d times, want once", b, got[b])
		}
	}
	if len(got) != len(bodies) {
		t.Errorf("%d bodies applied, want %d: %v", len(got), len(bodies), got)
	}
}

// TestHandlerAppliesOnce: events published twice each (a relay that
// crashed before marking them sent) are applied once each, and all are
// acknowledged.
func TestHandlerAppliesOnce(t *testing.T) {
	forEachLedger(t, func(t *testing.T, srv server, l *ledger) {
		js := srv.js(t)
		st, subject := newStream(t, js, 0)
		p := idemnats.NewPublisher(js)
		var bodies []string
		for i := range 20 {
			e := outbox.Event{ID: fmt.Sprintf("evt_%d", i), Subject: subject, Body: fmt.Appendf(nil, "body-%d", i)}
			bodies = append(bodies, string(e.Body))
			for range 2 {
				if err := p.Publish(t.Context(), e); err != nil {
					t.Fatal(err)
				}
			}
		}
		cons := durable(t, st, 0)
		var c counted
		consume(t, cons, idemnats.Handler(l.store, idemnats.ConsumerOptions{User: testUser, Operation: testOp}, c.wrap(l.apply)))
		testwait.Until(t, 0, "20 bodies applied and acked", func() bool {
			return len(l.applied(t)) == 20 && caughtUp(t, cons)
		})
		checkOnce(t, l, bodies)
		for _, b := range bodies {
			if n := c.get(b); n != 1 {
				t.Errorf("fn ran %d times for %s, want once", n, b)
			}
		}
	})
}

// TestHandlerRepeatPastWindow: a repeat of an id published after the
// stream's duplicate window (a relay down longer than it) is a second
// message in the stream; the handler replays it: fn runs once, both are
// acknowledged.
func TestHandlerRepeatPastWindow(t *testing.T) {
	forEachLedger(t, func(t *testing.T, srv server, l *ledger) {
		js := srv.js(t)
		st, subject := newStream(t, js, 100*time.Millisecond)
		if _, err := js.PublishMsg(t.Context(), idMsg(subject, "evt_late", "late")); err != nil {
			t.Fatal(err)
		}
		publishPastWindow(t, js, idMsg(subject, "evt_late", "late"))
		if n := msgCount(t, st); n != 2 {
			t.Fatalf("%d messages in the stream, want 2", n)
		}
		cons := durable(t, st, 0)
		var c counted
		consume(t, cons, idemnats.Handler(l.store, idemnats.ConsumerOptions{User: testUser, Operation: testOp}, c.wrap(l.apply)))
		testwait.Until(t, 0, "both messages acked", func() bool { return caughtUp(t, cons) })
		checkOnce(t, l, []string{"late"})
		if n := c.get("late"); n != 1 {
			t.Fatalf("fn ran %d times, want once", n)
		}
	})
}

// noAck is a message whose acks are lost: the consumer "crashed" after
// its commit, before the ack reached the server.
type noAck struct{ jetstream.Msg }

var errCrashed = errors.New("test: the consumer crashed before acking")

func (noAck) Ack() error                       { return errCrashed }
func (noAck) DoubleAck(context.Context) error  { return errCrashed }
func (noAck) Nak() error                       { return errCrashed }
func (noAck) NakWithDelay(time.Duration) error { return errCrashed }
func (noAck) Term() error                      { return errCrashed }
func (noAck) TermWithReason(string) error      { return errCrashed }
func (noAck) InProgress() error                { return errCrashed }

// TestHandlerCrashBeforeAck: every message's first delivery commits but
// its ack is lost; the server redelivers after the ack wait, and the
// redelivery replays: fn ran once per message, all are acknowledged.
func TestHandlerCrashBeforeAck(t *testing.T) {
	forEachLedger(t, func(t *testing.T, srv server, l *ledger) {
		js := srv.js(t)
		st, subject := newStream(t, js, 0)
		var bodies []string
		for i := range 5 {
			b := fmt.Sprintf("crash-%d", i)
			bodies = append(bodies, b)
			if _, err := js.PublishMsg(t.Context(), idMsg(subject, "evt_"+b, b)); err != nil {
				t.Fatal(err)
			}
		}
		cons := durable(t, st, time.Second)
		var c counted
		var logs syncBuffer
		h := idemnats.Handler(l.store, idemnats.ConsumerOptions{
			User: testUser, Operation: testOp,
			Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		}, c.wrap(l.apply))
		var redelivered atomic.Int64
		consume(t, cons, func(msg jetstream.Msg) {
			md, err := msg.Metadata()
			if err != nil {
				t.Error(err)
				return
			}
			if md.NumDelivered == 1 {
				h(noAck{msg})
				return
			}
			redelivered.Add(1)
			h(msg)
		})
		testwait.Until(t, 30*time.Second, "every message redelivered and acked", func() bool {
			return redelivered.Load() >= 5 && caughtUp(t, cons)
		})
		checkOnce(t, l, bodies)
		for _, b := range bodies {
			if n := c.get(b); n != 1 {
				t.Errorf("fn ran %d times for %s, want once", n, b)
			}
		}
		if !strings.Contains(logs.String(), "ack not confirmed") {
			t.Errorf("lost ack not logged: %s", logs.String())
		}
	})
}

// TestHandlerConcurrentConsumers: four instances (a connection and a
// store handle each) pull from one durable consumer. Two messages' first
// run is held until the server has redelivered them to another instance
// (ack wait passed), which finds the id in flight and naks: each message
// is still applied once.
func TestHandlerConcurrentConsumers(t *testing.T) {
	forEachLedger(t, func(t *testing.T, srv server, l *ledger) {
		js := srv.js(t)
		st, subject := newStream(t, js, 0)
		const n = 100
		var bodies []string
		for i := range n {
			b := fmt.Sprintf("c-%d", i)
			bodies = append(bodies, b)
			if _, err := js.PublishMsg(t.Context(), idMsg(subject, "evt_"+b, b)); err != nil {
				t.Fatal(err)
			}
		}
		durable(t, st, time.Second)

		// held[b] is closed once a second delivery of b was seen.
		var mu sync.Mutex
		held := map[string]chan struct{}{}
		// Fewer held messages than instances: the others keep consuming
		// and see the redeliveries.
		for _, i := range []int{0, n / 2} {
			held[bodies[i]] = make(chan struct{})
		}
		secondSeen := func(b string) {
			mu.Lock()
			defer mu.Unlock()
			if ch, ok := held[b]; ok {
				close(ch)
				delete(held, b)
			}
		}
		var c counted
		apply := c.wrap(l.apply)
		var firstRuns sync.Map
		slowFirst := func(ctx context.Context, input []byte) ([]byte, error) {
			mu.Lock()
			ch, ok := held[string(input)]
			mu.Unlock()
			if _, loaded := firstRuns.LoadOrStore(string(input), true); ok && !loaded {
				select {
				case <-ch:
				case <-time.After(20 * time.Second):
					return nil, errors.New("test: no second delivery came")
				}
			}
			return apply(ctx, input)
		}
		var inFlightNaks atomic.Int64
		for range 4 {
			js := srv.js(t)
			cons, err := js.Consumer(t.Context(), st.CachedInfo().Config.Name, "c")
			if err != nil {
				t.Fatal(err)
			}
			h := idemnats.Handler(l.open(t), idemnats.ConsumerOptions{
				User: testUser, Operation: testOp, NakDelay: 50 * time.Millisecond,
			}, slowFirst)
			consume(t, cons, func(msg jetstream.Msg) {
				if md, err := msg.Metadata(); err == nil && md.NumDelivered > 1 {
					secondSeen(string(msg.Data()))
					inFlightNaks.Add(1)
				}
				h(msg)
			})
		}
		testwait.Until(t, 60*time.Second, "every message applied and acked", func() bool {
			cons, err := js.Consumer(t.Context(), st.CachedInfo().Config.Name, "c")
			if err != nil {
				t.Fatal(err)
			}
			return len(l.applied(t)) == n && caughtUp(t, cons)
		})
		checkOnce(t, l, bodies)
		if inFlightNaks.Load() == 0 {
			t.Error("no message was redelivered while held: the in-flight path did not run")
		}
	})
}

// TestHandlerMismatch: an id repeated with other data (past the window)
// is terminated with an error logged; the first is applied, the second
// never.
func TestHandlerMismatch(t *testing.T) {
	forEachLedger(t, func(t *testing.T, srv server, l *ledger) {
		js := srv.js(t)
		st, subject := newStream(t, js, 100*time.Millisecond)
		if _, err := js.PublishMsg(t.Context(), idMsg(subject, "evt_m", "first")); err != nil {
			t.Fatal(err)
		}
		publishPastWindow(t, js, idMsg(subject, "evt_m", "second"))
		cons := durable(t, st, 0)
		var logs syncBuffer
		consume(t, cons, idemnats.Handler(l.store, idemnats.ConsumerOptions{
			User: testUser, Operation: testOp, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		}, l.apply))
		testwait.Until(t, 0, "both messages settled", func() bool { return caughtUp(t, cons) })
		checkOnce(t, l, []string{"first"})
		if !strings.Contains(logs.String(), "level=ERROR") || !strings.Contains(logs.String(), "terminated") {
			t.Fatalf("mismatch not logged as an error: %s", logs.String())
		}
	})
}

// TestHandlerKeys: a message without Nats-Msg-Id is claimed under its
// stream sequence; an id that is not a valid idem key, under its hash.
func TestHandlerKeys(t *testing.T) {
	forEachLedger(t, func(t *testing.T, srv server, l *ledger) {
		js := srv.js(t)
		st, subject := newStream(t, js, 0)
		if _, err := js.Publish(t.Context(), subject, []byte("anon")); err != nil {
			t.Fatal(err)
		}
		const badID = "an id with spaces"
		if _, err := js.PublishMsg(t.Context(), idMsg(subject, badID, "spaced")); err != nil {
			t.Fatal(err)
		}
		cons := durable(t, st, 0)
		consume(t, cons, idemnats.Handler(l.store, idemnats.ConsumerOptions{User: testUser, Operation: testOp}, l.apply))
		testwait.Until(t, 0, "the messages acked", func() bool { return caughtUp(t, cons) })
		checkOnce(t, l, []string{"anon", "spaced"})
		sum := sha256.Sum256([]byte(badID))
		for key, body := range map[string]string{
			fmt.Sprintf("seq-%s-1", st.CachedInfo().Config.Name): "anon",
			"msgid-sha256-" + hex.EncodeToString(sum[:]):         "spaced",
		} {
			rec, err := l.store.Get(t.Context(), testUser, key)
			if err != nil {
				t.Fatalf("record %s: %v", key, err)
			}
			if rec.Response == nil || string(rec.Response.Body) != "ok "+body {
				t.Fatalf("record %s: %+v, want the output of %s stored", key, rec, body)
			}
		}
	})
}

// TestHandlerKeysDoNotCollide: a publisher's id that looks like a key
// MessageKey derives ("seq-…", "msgid-sha256-…") is hashed too, so it
// cannot take the key of another message: every message here is applied.
func TestHandlerKeysDoNotCollide(t *testing.T) {
	forEachLedger(t, func(t *testing.T, srv server, l *ledger) {
		js := srv.js(t)
		st, subject := newStream(t, js, 0)
		name := st.CachedInfo().Config.Name
		const badID = "an id with spaces"
		sum := sha256.Sum256([]byte(badID))
		msgs := []*nats.Msg{
			nats.NewMsg(subject), // no id: seq-<stream>-1
			idMsg(subject, fmt.Sprintf("seq-%s-1", name), "seq-lookalike"),
			idMsg(subject, badID, "spaced"),
			idMsg(subject, "msgid-sha256-"+hex.EncodeToString(sum[:]), "hash-lookalike"),
		}
		msgs[0].Data = []byte("anon")
		for _, m := range msgs {
			if _, err := js.PublishMsg(t.Context(), m); err != nil {
				t.Fatal(err)
			}
		}
		cons := durable(t, st, 0)
		consume(t, cons, idemnats.Handler(l.store, idemnats.ConsumerOptions{User: testUser, Operation: testOp}, l.apply))
		testwait.Until(t, 0, "the messages acked", func() bool { return caughtUp(t, cons) })
		checkOnce(t, l, []string{"anon", "seq-lookalike", "spaced", "hash-lookalike"})
	})
}

// TestHandlerRetriesFailures: fn's error and panic roll back and nak;
// the redelivery applies the message once.
func TestHandlerRetriesFailures(t *testing.T) {
	forEachLedger(t, func(t *testing.T, srv server, l *ledger) {
		js := srv.js(t)
		st, subject := newStream(t, js, 0)
		for _, b := range []string{"fails", "panics"} {
			if _, err := js.PublishMsg(t.Context(), idMsg(subject, "evt_"+b, b)); err != nil {
				t.Fatal(err)
			}
		}
		var c counted
		apply := c.wrap(l.apply)
		fn := func(ctx context.Context, input []byte) ([]byte, error) {
			out, err := apply(ctx, input) // writes, then fails: must roll back
			if err != nil {
				return nil, err
			}
			if c.get(string(input)) == 1 {
				if string(input) == "panics" {
					panic("test: first run panics")
				}
				return nil, errors.New("test: first run fails")
			}
			return out, nil
		}
		cons := durable(t, st, 0)
		var logs syncBuffer
		consume(t, cons, idemnats.Handler(l.store, idemnats.ConsumerOptions{
			User: testUser, Operation: testOp, NakDelay: 10 * time.Millisecond,
			Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		}, fn))
		testwait.Until(t, 0, "both messages acked", func() bool { return caughtUp(t, cons) })
		checkOnce(t, l, []string{"fails", "panics"})
		for _, b := range []string{"fails", "panics"} {
			if n := c.get(b); n != 2 {
				t.Errorf("fn ran %d times for %s, want 2", n, b)
			}
		}
	})
}

func TestHandlerRefusesBadOptions(t *testing.T) {
	for _, o := range []idemnats.ConsumerOptions{{User: "u"}, {Operation: "op"}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Handler(%+v) did not panic", o)
				}
			}()
			idemnats.Handler(memstore.New(memstore.Options{}), o, func(context.Context, []byte) ([]byte, error) { return nil, nil })
		}()
	}
}

// TestConsumeStopWaits: stop returns only after the message being handled
// is finished.
func TestConsumeStopWaits(t *testing.T) {
	forEach(t, func(t *testing.T, srv server) {
		js := srv.js(t)
		st, subject := newStream(t, js, 0)
		if _, err := js.Publish(t.Context(), subject, []byte("x")); err != nil {
			t.Fatal(err)
		}
		cons := durable(t, st, 0)
		entered := make(chan struct{})
		release := make(chan struct{})
		var done atomic.Bool
		stop, err := idemnats.Consume(context.Background(), cons, func(msg jetstream.Msg) {
			close(entered)
			<-release
			done.Store(true)
		})
		if err != nil {
			t.Fatal(err)
		}
		<-entered
		stopped := make(chan struct{})
		go func() { stop(); close(stopped) }()
		close(release)
		<-stopped
		if !done.Load() {
			t.Fatal("stop returned while the handler was running")
		}
		stop()
	})
}

// TestConsumeContext: the consumer stops when ctx ends.
func TestConsumeContext(t *testing.T) {
	forEach(t, func(t *testing.T, srv server) {
		js := srv.js(t)
		st, subject := newStream(t, js, 0)
		cons := durable(t, st, 0)
		ctx, cancel := context.WithCancel(context.Background())
		var got atomic.Int64
		stop, err := idemnats.Consume(ctx, cons, func(msg jetstream.Msg) {
			got.Add(1)
			_ = msg.Ack()
		})
		if err != nil {
			t.Fatal(err)
		}
		defer stop()
		if _, err := js.Publish(t.Context(), subject, []byte("1")); err != nil {
			t.Fatal(err)
		}
		testwait.Until(t, 0, "the first message", func() bool { return got.Load() == 1 })
		cancel()
		stop() // returns: the consumer stopped on ctx
		if _, err := js.Publish(t.Context(), subject, []byte("2")); err != nil {
			t.Fatal(err)
		}
		// The server counts the new message as pending a moment after
		// the publish is acknowledged (its consumer state is updated
		// apart from the stream's), and the first message's ack, sent
		// without waiting for the server, may still be on its way: wait
		// for both, then check that nobody took the second. A consumer
		// that had taken it would have handled it (got 2), and the wait
		// would end with it still delivered, unacknowledged or pending.
		var info *jetstream.ConsumerInfo
		testwait.Until(t, 10*time.Second, "the second message pending on the consumer and the first one's ack counted", func() bool {
			var err error
			info, err = cons.Info(t.Context())
			return err == nil && info.NumPending >= 1 && info.NumAckPending == 0
		})
		if info.NumPending != 1 || info.NumAckPending != 0 || got.Load() != 1 {
			t.Fatalf("after stop: %d pending, %d delivered unacknowledged, %d handled; want 1, 0, 1", info.NumPending, info.NumAckPending, got.Load())
		}
	})
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
