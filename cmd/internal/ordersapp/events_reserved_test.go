package ordersapp

import (
	"context"
	"errors"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/outbox"
)

// TestEventsConsumerUserReserved: the receipts consumer claims message ids
// as the idem user "$consumer:receipts". A bearer token whose sub names
// it (or any sub that starts with "$") is refused with 401, and `orders
// token` will not make one: no API client can claim an event's id in the
// consumer's namespace first, which would make the consumer terminate the
// message and leave the order without its receipt. The audit reports an
// event the consumer acknowledged without a receipt: here, a claim planted
// under the consumer's user with other data (as a client could make before
// the sub was reserved).
func TestEventsConsumerUserReserved(t *testing.T) {
	ordersBin, _ := binaries(t)
	dir := t.TempDir()
	addr := freeAddr(t)
	base := "http://" + addr
	start(t, base+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", dir, "--jwt-secret", testSecret, "--consume=false")
	js := embeddedJS(t, dir)

	for i, key := range []string{"reserved-0", "reserved-1"} {
		if s, err := post(http.DefaultClient, base, "alice", key, i); s != http.StatusCreated {
			t.Fatalf("order %s: %d %v", key, s, err)
		}
	}
	testwait.Until(t, 20*time.Second, "the relay to publish both events", func() bool { return streamMsgs(t, js) == 2 })
	be := openBE(t, dir, "")
	var events []string
	if err := be.outbox.Each(context.Background(), func(e outbox.Event, _ time.Time) error {
		events = append(events, e.ID)
		return nil
	}); err != nil || len(events) != 2 {
		t.Fatalf("want 2 events in the outbox, got %v (%v)", events, err)
	}

	// An API client whose sub is the consumer's user, or any "$" sub.
	for _, sub := range []string{receiptsUser, "$consumer:ledger", "$"} {
		tok, err := jwt.NewWithClaims(jwt.SigningMethodHS256, jwt.RegisteredClaims{
			Subject:   sub,
			ExpiresAt: jwt.NewNumericDate(time.Now().Add(time.Hour)),
		}).SignedString([]byte(testSecret))
		if err != nil {
			t.Fatal(err)
		}
		req, _ := http.NewRequest("POST", base+"/v1/orders", strings.NewReader(orderBody(7)))
		req.Header.Set("Authorization", "Bearer "+tok)
		req.Header.Set("Idempotency-Key", events[0])
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("POST /v1/orders with sub %q and key %s: %d, want 401", sub, events[0], resp.StatusCode)
		}
	}
	out, err := exec.Command(ordersBin, "token", "--user", receiptsUser, "--jwt-secret", testSecret).CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), "reserved") {
		t.Errorf("orders token --user %s: %v, want exit 2 saying it is reserved:\n%s", receiptsUser, err, out)
	}

	// A claim planted under the consumer's user with other data: the
	// consumer terminates that message and writes no receipt for it.
	_, err = idem.Do(context.Background(), be.store, idem.DoParams{User: receiptsUser, Key: events[1], Operation: receiptsOp, Input: []byte("not the event")},
		func(context.Context, []byte) ([]byte, error) { return []byte("{}"), nil })
	if err != nil {
		t.Fatal(err)
	}
	startConsume(t, ordersBin, "--data-dir", dir)
	waitConsumed(t, js, 30*time.Second)
	if n := countReceipts(t, be); n != 1 {
		t.Fatalf("%d receipts, want 1 (the other message terminated)", n)
	}
	out, err = exec.Command(ordersBin, "audit", "--data-dir", dir).CombinedOutput()
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Errorf("orders audit: %v, want exit 1\n%s", err, out)
	}
	want := "order " + orderOfEvent(events[1]) + "'s event " + events[1] + " was acknowledged by consumer receipts but has no receipt"
	if !strings.Contains(string(out), want) {
		t.Errorf("the audit does not say %q:\n%s", want, out)
	}
	t.Logf("audit:\n%s", out)
}
