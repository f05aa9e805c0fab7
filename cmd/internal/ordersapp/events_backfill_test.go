package ordersapp

import (
	"database/sql"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/testwait"
)

// TestEventsBackfillOnUpgrade: orders written before the service wrote
// events (here: their events deleted, the stream with them) get their
// orders.created event from `orders migrate` and from serve in the
// background at start; the
// relay publishes them, the consumer writes their receipts, and the audit
// is clean: one event, one message id and one receipt per order. (The
// second serve also sets the consumer's AckWait with --ack-wait.)
func TestEventsBackfillOnUpgrade(t *testing.T) {
	ordersBin, _ := binaries(t)
	dir := t.TempDir()
	addr := freeAddr(t)
	base := "http://" + addr
	first := start(t, base+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", dir, "--jwt-secret", testSecret, "--consume=false")
	const n = 12
	for i := range n {
		if s, err := post(http.DefaultClient, base, fmt.Sprintf("old-user-%d", i%3), fmt.Sprintf("old-%d", i), i); s != http.StatusCreated {
			t.Fatalf("order %d: %d %v", i, s, err)
		}
	}
	first.kill()
	// As a database of the version before events: no outbox rows, no stream.
	db, err := sql.Open("sqlite", filepath.Join(dir, "orders.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	exec := func(q string) {
		t.Helper()
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	exec(`DELETE FROM idem_outbox`)
	exec(`UPDATE orders SET event_added = NULL`) // as migrated from before the marker
	exec(`DELETE FROM event_stream`)             // that version recorded no stream
	if err := os.RemoveAll(filepath.Join(dir, "nats")); err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(dir, natsURLFile))

	code, out, errs := run(t, nil, "migrate", "--data-dir", dir)
	if code != 0 || !strings.Contains(out, fmt.Sprintf("wrote the orders.created event of %d orders made before events", n)) {
		t.Fatalf("orders migrate = %d\n%s%s", code, out, errs)
	}
	if code, out, _ := run(t, nil, "migrate", "--data-dir", dir); code != 0 || strings.Contains(out, "wrote") {
		t.Errorf("a second migrate wrote events again:\n%s", out)
	}
	// Five of them lost again: serve writes them at start.
	exec(`DELETE FROM idem_outbox WHERE id IN (SELECT id FROM idem_outbox ORDER BY seq LIMIT 5)`)
	exec(`UPDATE orders SET event_added = NULL`) // as migrated from before the marker

	second := start(t, base+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", dir, "--jwt-secret", testSecret, "--ack-wait", "47s")
	testwait.Until(t, 20*time.Second, "serve to say it wrote 5 events", func() bool {
		return strings.Contains(second.logs.String(), "every order made before events") && strings.Contains(second.logs.String(), "orders=5")
	})
	js := embeddedJS(t, dir)
	testwait.Until(t, 30*time.Second, "the relay to publish every event", func() bool { return streamMsgs(t, js) == n })
	waitConsumed(t, js, 30*time.Second)
	if got := consumerInfo(t, js).Config.AckWait; got != 47*time.Second {
		t.Errorf("the receipts consumer's AckWait = %v, want serve's --ack-wait 47s", got)
	}
	wantEventAudit(t, auditOut(t, ordersBin, "--data-dir", dir), n, 0)
}
