package ordersapp

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/internal/testwait"
)

// TestEmbeddedNATSRefusesClientsWithoutToken: the embedded NATS of a serve
// refuses a local process that connects to the port in <data-dir>/nats.url
// without the token of <data-dir>/nats.token (it can neither publish nor
// reach the stream's API), and the token file is its owner's alone; the
// token is in no log line.
func TestEmbeddedNATSRefusesClientsWithoutToken(t *testing.T) {
	ordersBin, _ := binaries(t)
	dir := t.TempDir()
	addr := freeAddr(t)
	p := start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", dir, "--jwt-secret", testSecret)
	url := embeddedURL(t, dir)
	for name, opts := range map[string][]nats.Option{
		"no credential":   nil,
		"a wrong token":   {nats.Token("0123456789abcdef")},
		"a user/password": {nats.UserInfo("mallory", "secret")},
	} {
		nc, err := nats.Connect(url, append(opts, nats.Timeout(5*time.Second), nats.NoReconnect())...)
		if err == nil {
			nc.Close()
			t.Errorf("%s: connected to the embedded NATS; want it refused", name)
			continue
		}
		if !errors.Is(err, nats.ErrAuthorization) {
			t.Errorf("%s: %v; want an authorization violation", name, err)
		}
	}
	tok := embeddedToken(t, dir)
	if fi, err := os.Stat(filepath.Join(dir, natsTokenFile)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("%s: %v; want a file of mode 0600", natsTokenFile, err)
	}
	js := embeddedJS(t, dir) // with the token: the operator's way in
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	testwait.Until(t, 20*time.Second, "stream ORDERS to exist", func() bool {
		_, err := js.Stream(ctx, eventStream)
		return err == nil
	})
	p.cmd.Process.Signal(os.Interrupt)
	if err := p.cmd.Wait(); err != nil {
		t.Errorf("serve did not stop cleanly: %v", err)
	}
	if strings.Contains(p.logs.String(), tok) {
		t.Errorf("serve logged the embedded NATS server's token")
	}

	// A restart on the same data dir keeps the token.
	addr = freeAddr(t)
	start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", dir, "--jwt-secret", testSecret)
	if again := embeddedToken(t, dir); again != tok {
		t.Errorf("a restart made another token")
	}
	embeddedJS(t, dir)
}

// TestForgedEventsGetNoReceipt: events published to stream ORDERS by a
// client holding the token (as an operator on the machine can), whose
// order does not exist or differs from the event (another user, another
// total), are terminated by the receipts consumer with an error naming
// the event id, and get no receipt; the real order's event gets its one
// receipt, and the audit reports the forged messages.
func TestForgedEventsGetNoReceipt(t *testing.T) {
	ordersBin, _ := binaries(t)
	dir := t.TempDir()
	addr := freeAddr(t)
	p := start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", dir, "--jwt-secret", testSecret)
	if s, err := post(retrying(), "http://"+addr, "alice", "real-1", 1); s != http.StatusCreated {
		t.Fatalf("order: %d %v", s, err)
	}
	js := embeddedJS(t, dir)
	testwait.Until(t, 20*time.Second, "the relay to publish the order's event", func() bool { return streamMsgs(t, js) == 1 })
	waitConsumed(t, js, 30*time.Second)

	be, err := openBackend(context.Background(), &Config{DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer be.close()
	realID, realBody := oneEvent(t, be)
	var real orders.Order
	if err := json.Unmarshal(realBody, &real); err != nil {
		t.Fatal(err)
	}

	forged := map[string]orders.Order{} // by the message id it is published with
	ghost := real
	ghost.ID, ghost.UserID, ghost.Total = "ord_ffffffffffffffffffffffff", "mallory", 99999
	ghost.Items = []orders.Item{{SKU: "SKU-X", Quantity: 1, UnitPrice: 99999}}
	forged[orders.EventID(ghost.ID)] = ghost
	other := real
	other.UserID = "mallory"
	forged["evt_forged_other_user"] = other
	dearer := real
	dearer.Total *= 10
	forged["evt_forged_other_total"] = dearer
	for id, o := range forged {
		body, err := orders.OrderJSON(&o)
		if err != nil {
			t.Fatal(err)
		}
		msg := &nats.Msg{Subject: eventSubject, Data: body, Header: nats.Header{}}
		msg.Header.Set(jetstream.MsgIDHeader, id)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err = js.PublishMsg(ctx, msg)
		cancel()
		if err != nil {
			t.Fatalf("publishing %s: %v", id, err)
		}
	}
	waitConsumed(t, js, 30*time.Second)

	receipts := map[string]orders.Receipt{}
	if err := be.allReceipts(context.Background(), func(r orders.Receipt) error { receipts[r.OrderID] = r; return nil }); err != nil {
		t.Fatal(err)
	}
	if len(receipts) != 1 || receipts[real.ID].EventID != realID || receipts[real.ID].Total != real.Total || receipts[real.ID].UserID != real.UserID {
		t.Errorf("receipts %+v; want one, the real order's (%s, %q, %d)", receipts, real.ID, real.UserID, real.Total)
	}
	testwait.Until(t, 10*time.Second, "serve to log each forged event", func() bool {
		logs := p.logs.String()
		for id := range forged {
			if !strings.Contains(logs, "event_id="+id) {
				return false
			}
		}
		return true
	})
	for _, line := range strings.Split(p.logs.String(), "\n") {
		if strings.Contains(line, "no order of the database backs") && !strings.Contains(line, "level=ERROR") {
			t.Errorf("a forged event logged below error level: %s", line)
		}
	}

	out, err := exec.Command(ordersBin, "audit", "--data-dir", dir).CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 1 {
		t.Fatalf("audit: %v; want exit 1 on the forged messages\n%s", err, out)
	}
	if !strings.Contains(string(out), orders.EventID(ghost.ID)) || !strings.Contains(string(out), "no order "+ghost.ID) {
		t.Errorf("the audit does not report the message of order %s, which does not exist:\n%s", ghost.ID, out)
	}
	if strings.Contains(string(out), "no receipt") {
		t.Errorf("the audit reports a missing receipt:\n%s", out)
	}
}
