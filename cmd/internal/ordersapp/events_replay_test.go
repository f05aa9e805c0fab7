package ordersapp

import (
	"context"
	"database/sql"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/testwait"
)

// TestEventsReplayAfterKeysExpire: stream ORDERS keeps its messages for
// ever, the consumer's message ids only for the key TTL. Orders get their
// receipts; the consumer's keys then expire and `orders gc` deletes them;
// the durable consumer is deleted, so that the next `orders consume`
// receives the whole stream again. Every message is acknowledged without
// an error, and each order still has one receipt: the receipts table is
// unique on the event, and a receipt found written is the event applied.
// The audit is clean; with the unique index dropped and a second receipt
// planted, it names the order and exits 1.
//
// Each subtest has a NATS of its own (testNATS), never the shared external
// one.
func TestEventsReplayAfterKeysExpire(t *testing.T) {
	t.Parallel()
	t.Run("SQLite", func(t *testing.T) { replayAfterKeysExpire(t, "") })
	t.Run("PostgreSQL", func(t *testing.T) { replayAfterKeysExpire(t, pgtest.Database(t)) })
}

func replayAfterKeysExpire(t *testing.T, dbURL string) {
	ordersBin, _ := binaries(t)
	dir := t.TempDir()
	natsURL := testNATS(t)
	storage := []string{"--data-dir", dir}
	if dbURL != "" {
		storage = append(storage, "--database-url", dbURL)
	}
	withNATS := append(append([]string{}, storage...), "--nats-url", natsURL)
	addr := freeAddr(t)
	base := "http://" + addr
	start(t, base+"/healthz", ordersBin, append([]string{"serve", "--addr", addr, "--jwt-secret", testSecret, "--consume=false"}, withNATS...)...)
	js := natsJS(t, natsURL)

	const n = 12
	for i := range n {
		if s, err := post(http.DefaultClient, base, fmt.Sprintf("replay-user-%d", i%3), fmt.Sprintf("replay-%d", i), i); s != http.StatusCreated {
			t.Fatalf("order %d: %d %v", i, s, err)
		}
	}
	testwait.Until(t, 30*time.Second, "the relay to publish every event", func() bool { return streamMsgs(t, js) == n })
	first := startConsume(t, ordersBin, withNATS...)
	waitConsumed(t, js, 30*time.Second)
	first.stop(t)
	if got := consumerKeys(t, dir, dbURL); got != n {
		t.Fatalf("%d message ids of the consumer stored, want %d", got, n)
	}

	// The key TTL passes; the cleaner deletes the consumer's keys.
	execDB(t, dir, dbURL, map[bool]string{
		false: `UPDATE idempotency_keys SET expires_at = 0 WHERE user_id = ?`,
		true:  `UPDATE idempotency_keys SET expires_at = now() - interval '1 hour' WHERE user_id = $1`,
	}[dbURL != ""], receiptsUser)
	if code, out, errs := run(t, nil, append([]string{"gc"}, storage...)...); code != 0 {
		t.Fatalf("orders gc = %d\n%s%s", code, out, errs)
	}
	if got := consumerKeys(t, dir, dbURL); got != 0 {
		t.Fatalf("%d message ids of the consumer left after orders gc, want 0", got)
	}

	// The stream delivered again from its start.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := js.DeleteConsumer(ctx, eventStream, receiptsDurable); err != nil {
		t.Fatalf("deleting consumer %s: %v", receiptsDurable, err)
	}
	second := startConsume(t, ordersBin, withNATS...)
	waitConsumed(t, js, 30*time.Second)
	if info := consumerInfo(t, js); info.Delivered.Stream != n || info.NumRedelivered != 0 {
		t.Errorf("the replay delivered up to stream sequence %d with %d redelivered, want %d and 0 (each message acknowledged at once)",
			info.Delivered.Stream, info.NumRedelivered, n)
	}
	logs := second.stop(t)
	if strings.Contains(logs, "not applied") || strings.Contains(logs, "terminated") {
		t.Errorf("the replay logged a failed or dropped message:\n%s", tail(logs, 20))
	}
	if got := consumerKeys(t, dir, dbURL); got != n {
		t.Errorf("%d message ids of the consumer stored after the replay, want %d (each applied again, as a no-op)", got, n)
	}

	be, err := openBackend(context.Background(), &Config{DataDir: dir, DatabaseURL: dbURL})
	if err != nil {
		t.Fatal(err)
	}
	defer be.close()
	perOrder := map[string]int{}
	var planted orders.Receipt
	if err := be.allReceipts(context.Background(), func(r orders.Receipt) error { perOrder[r.OrderID]++; planted = r; return nil }); err != nil {
		t.Fatal(err)
	}
	for id, c := range perOrder {
		if c != 1 {
			t.Errorf("order %s has %d receipts after the replay, want 1", id, c)
		}
	}
	if len(perOrder) != n {
		t.Errorf("%d orders with a receipt, want %d", len(perOrder), n)
	}
	wantEventAudit(t, auditOut(t, ordersBin, withNATS...), n, 0)

	// A second receipt that only a database without the unique index can
	// hold: the audit reports it.
	execDB(t, dir, dbURL, `DROP INDEX receipts_event_id_user_id`)
	execDB(t, dir, dbURL, map[bool]string{
		false: `INSERT INTO receipts (id, order_id, event_id, user_id, total, currency, created_at)
			SELECT 'rcp_planted', order_id, event_id, user_id, total, currency, created_at FROM receipts WHERE id = ?`,
		true: `INSERT INTO receipts (id, order_id, event_id, user_id, total, currency, created_at)
			SELECT 'rcp_planted', order_id, event_id, user_id, total, currency, created_at FROM receipts WHERE id = $1`,
	}[dbURL != ""], planted.ID)
	code, out, errs := run(t, nil, append([]string{"audit"}, withNATS...)...)
	want := fmt.Sprintf("order %s has 2 receipts", planted.OrderID)
	if code != 1 || !strings.Contains(out+errs, want) {
		t.Errorf("orders audit with a planted second receipt = exit %d, want 1 and a line %q:\n%s%s", code, want, out, errs)
	}
}

// execDB runs one statement on the test's database: the SQLite file in dir
// when dbURL is empty, else the PostgreSQL database at dbURL.
func execDB(t *testing.T, dir, dbURL, query string, args ...any) {
	t.Helper()
	ctx := context.Background()
	if dbURL == "" {
		db, err := sql.Open("sqlite", filepath.Join(dir, "orders.db"))
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		if _, err := db.ExecContext(ctx, query, args...); err != nil {
			t.Fatalf("%s: %v", query, err)
		}
		return
	}
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, query, args...); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
}

// consumerKeys counts the receipts consumer's stored message ids.
func consumerKeys(t *testing.T, dir, dbURL string) int {
	t.Helper()
	ctx := context.Background()
	var n int
	if dbURL == "" {
		db, err := sql.Open("sqlite", filepath.Join(dir, "orders.db"))
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idempotency_keys WHERE user_id = ?`, receiptsUser).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE user_id = $1`, receiptsUser).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
