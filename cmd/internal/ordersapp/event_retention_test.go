package ordersapp

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/outbox"
)

// TestOutboxSweptEventsAudited: serve deletes the outbox's events once sent
// and older than --outbox-retention; the audit checks a swept event's
// message in the stream against its order, a restart writes none of them
// again, and a swept event whose message is gone is a violation.
func TestOutboxSweptEventsAudited(t *testing.T) {
	skipInShort(t, "runs the service, NATS and the audit")
	t.Parallel()
	dir, natsURL, inst := sweepService(t, func(c *Config) {
		c.Consume, c.OutboxRetention, c.outboxSweepEvery = true, time.Millisecond, 50*time.Millisecond
	})
	const n = 5
	for i := range n {
		if s, err := post(http.DefaultClient, inst.base, "sweeper", fmt.Sprintf("sweep-%d", i), i); s != http.StatusCreated {
			t.Fatalf("order %d: %d %v", i, s, err)
		}
	}
	outboxRows := func(be *backend) int {
		t.Helper()
		rows := 0
		if err := be.outbox.Each(context.Background(), func(outbox.Event, time.Time) error { rows++; return nil }); err != nil {
			t.Fatal(err)
		}
		return rows
	}
	testwait.Until(t, 30*time.Second, "every event sent and swept from the outbox", func() bool { return outboxRows(inst.srv.backend) == 0 })
	testwait.Until(t, 30*time.Second, "every order's receipt", func() bool { return countReceipts(t, inst.srv.backend) == n })
	if !strings.Contains(inst.logs.String(), "deleted sent events from the outbox") {
		t.Errorf("serve logged no sweep:\n%s", tail(inst.logs.String(), 20))
	}
	inst.stop()

	audit := func() (int, string) {
		t.Helper()
		code, out, errs := run(t, nil, "audit", "--data-dir", dir, "--nats-url", natsURL)
		return code, out + errs
	}
	code, out := audit()
	if code != 0 || !strings.Contains(out, fmt.Sprintf("0 in the outbox (0 sent, 0 unsent: pending the relay, 0 of them already in the stream); %d more sent and swept", n)) ||
		!strings.Contains(out, fmt.Sprintf("%d messages, %d distinct message ids, 0 repeated", n, n)) || !strings.Contains(out, fmt.Sprintf("events per order:  %d orders with 1", n)) {
		t.Fatalf("audit after the sweep: exit %d, want 0, %d events swept and %d messages\n%s", code, n, n, out)
	}

	// A restart writes none of the swept events again: every order is
	// marked as having had its event.
	be := openBE(t, dir, "")
	if added, err := backfillEvents(context.Background(), be, slog.New(slog.DiscardHandler)); err != nil || added != 0 {
		t.Errorf("backfill after the sweep added %d events (%v), want 0", added, err)
	}
	if rows := outboxRows(be); rows != 0 {
		t.Errorf("%d events in the outbox after the backfill, want 0", rows)
	}

	// A swept event whose message is gone is a violation.
	ctx, _, st := ordersStream(t, natsURL)
	first, err := st.GetMsg(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.DeleteMsg(ctx, 1); err != nil {
		t.Fatal(err)
	}
	id := first.Header.Get(jetstream.MsgIDHeader)
	code, out = audit()
	want := fmt.Sprintf("event %s of order %s is no longer in the outbox (swept once sent, or deleted) but stream %s has no message with its id", id, orderOfEvent(id), eventStream)
	if code != 1 || !strings.Contains(out, want) {
		t.Errorf("audit once a swept event's message is deleted: exit %d, want 1 and %q\n%s", code, want, out)
	}
}

// TestOutboxSweepMarksBeforeDeleting: a sweep round backfills before it
// deletes, so that an order an older binary wrote (unmarked, its event
// sent) is marked before its event goes: a later backfill then does not
// write that event, and the relay does not publish it, a second time.
func TestOutboxSweepMarksBeforeDeleting(t *testing.T) {
	skipInShort(t, "runs the service and NATS")
	t.Parallel()
	dir, _, inst := sweepService(t, nil) // --outbox-retention 0: no sweep of its own
	const n = 3
	for i := range n {
		if s, err := post(http.DefaultClient, inst.base, "straggler", fmt.Sprintf("old-%d", i), i); s != http.StatusCreated {
			t.Fatalf("order %d: %d %v", i, s, err)
		}
	}
	be := inst.srv.backend
	sentRows := func() (sent, all int) {
		t.Helper()
		err := be.outbox.Each(context.Background(), func(_ outbox.Event, sentAt time.Time) error {
			all++
			if !sentAt.IsZero() {
				sent++
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return sent, all
	}
	testwait.Until(t, 30*time.Second, "every event sent", func() bool { sent, _ := sentRows(); return sent == n })
	// As an older binary writes them: unmarked.
	db, err := sql.Open("sqlite", filepath.Join(dir, "orders.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`UPDATE orders SET event_added = NULL`); err != nil {
		t.Fatal(err)
	}

	inst.srv.sweepOutboxOnce(context.Background(), be.outbox.(outbox.Sweeper), time.Nanosecond)
	if _, all := sentRows(); all != 0 {
		t.Errorf("%d events left in the outbox after the sweep, want 0", all)
	}
	var unmarked int
	if err := db.QueryRow(`SELECT count(*) FROM orders WHERE event_added IS NULL`).Scan(&unmarked); err != nil || unmarked != 0 {
		t.Errorf("%d orders unmarked after the sweep (%v), want 0: the sweep deleted events of orders a backfill would write again", unmarked, err)
	}
	if added, err := backfillEvents(context.Background(), be, slog.New(slog.DiscardHandler)); err != nil || added != 0 {
		t.Errorf("backfill after the sweep added %d events (%v), want 0", added, err)
	}
}

// sweepService starts an order service on SQLite in a new data dir, with an
// in-process NATS; adjust changes its Config first (nil: none).
func sweepService(t *testing.T, adjust func(*Config)) (dir, natsURL string, inst *inProcess) {
	t.Helper()
	_, natsURL = inProcNATS(t)
	dir = t.TempDir()
	c := &Config{DataDir: dir, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: 30 * time.Second, PaymentsKey: "sk_test_local",
		RequireKey: true, NATSURL: natsURL}
	if adjust != nil {
		adjust(c)
	}
	return dir, natsURL, startInProcess(t, c)
}

// TestAuditStreamMaxAge: once an operator gives stream ORDERS a maximum
// age, the messages older than it are gone; the audit accepts that for the
// orders older than it whose receipts were written, and reports an order
// whose message went before its receipt was written.
func TestAuditStreamMaxAge(t *testing.T) {
	skipInShort(t, "runs the service, NATS and the audit")
	t.Parallel()
	dir, natsURL, inst := sweepService(t, func(c *Config) { c.Consume = true })
	const n = 3
	for i := range n {
		if s, err := post(http.DefaultClient, inst.base, "aging", fmt.Sprintf("age-%d", i), i); s != http.StatusCreated {
			t.Fatalf("order %d: %d %v", i, s, err)
		}
	}
	testwait.Until(t, 30*time.Second, "every order's receipt", func() bool { return countReceipts(t, inst.srv.backend) == n })
	inst.stop()

	ctx, js, st := ordersStream(t, natsURL)
	cfg := st.CachedInfo().Config
	cfg.MaxAge, cfg.Duplicates = time.Second, time.Second // a window no longer than the age, as JetStream requires
	st, err := js.UpdateStream(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 20*time.Second, "the messages past the stream's maximum age to be gone", func() bool {
		info, err := st.Info(ctx)
		return err == nil && info.State.Msgs == 0
	})

	audit := func() (int, string) {
		t.Helper()
		code, out, errs := run(t, nil, "audit", "--data-dir", dir, "--nats-url", natsURL)
		return code, out + errs
	}
	code, out := audit()
	if code != 0 || !strings.Contains(out, fmt.Sprintf("stream max age:    1s: %d sent events' messages are past it and gone", n)) {
		t.Fatalf("audit once every message is past the stream's maximum age: exit %d, want 0 and %d messages gone\n%s", code, n, out)
	}

	// A receipt missing for an order whose message is gone: the event was
	// never applied, and never will be.
	db, err := sql.Open("sqlite", filepath.Join(dir, "orders.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var orderID string
	if err := db.QueryRow(`SELECT order_id FROM receipts ORDER BY order_id LIMIT 1`).Scan(&orderID); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`DELETE FROM receipts WHERE order_id = ?`, orderID); err != nil {
		t.Fatal(err)
	}
	code, out = audit()
	want := fmt.Sprintf("order %s's event %s was removed from stream %s by its maximum age (1s) before the consumer wrote its receipt", orderID, orders.EventID(orderID), eventStream)
	if code != 1 || !strings.Contains(out, want) {
		t.Errorf("audit of an order whose message went before its receipt: exit %d, want 1 and %q\n%s", code, want, out)
	}
}

// ordersStream connects to the NATS at url and returns stream ORDERS on
// it, with a context for the test's calls; both end with t.
func ordersStream(t *testing.T, url string) (context.Context, jetstream.JetStream, jetstream.Stream) {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	st, err := js.Stream(ctx, eventStream)
	if err != nil {
		t.Fatal(err)
	}
	return ctx, js, st
}
