package ordersapp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/cmd/internal/faultproxy"
	"github.com/idem-go/idem/idemnats"
)

// TestAuditWaitsOutNoResponders: the audit's JetStream calls try again
// while the cluster has no responder (a leader election), and give the
// error back once the wait is over or on any other error at once.
func TestAuditWaitsOutNoResponders(t *testing.T) {
	ctx := context.Background()
	calls := 0
	v, err := whileNoResponders(ctx, 10*time.Second, func() (int, error) {
		calls++
		if calls < 3 {
			return 0, nats.ErrNoResponders
		}
		return 7, nil
	})
	if err != nil || v != 7 || calls != 3 {
		t.Errorf("an election that ends: %d, %v after %d calls; want 7, nil after 3", v, err, calls)
	}

	calls = 0
	began := time.Now()
	_, err = whileNoResponders(ctx, time.Second, func() (int, error) { calls++; return 0, nats.ErrNoResponders })
	if !errors.Is(err, nats.ErrNoResponders) || time.Since(began) > 5*time.Second || calls < 2 {
		t.Errorf("no JetStream at all: %v after %v and %d calls; want no responders, back within the wait", err, time.Since(began), calls)
	}

	calls = 0
	other := errors.New("stream not found")
	if _, err = whileNoResponders(ctx, 10*time.Second, func() (int, error) { calls++; return 0, other }); !errors.Is(err, other) || calls != 1 {
		t.Errorf("another error: %v after %d calls; want it at once", err, calls)
	}
}

// TestReadStreamAfterAnEmptyFetch: a fetch that comes back empty before
// the stream's last message does not end the audit's read of stream
// ORDERS. Here, from the second fetch on, the link from NATS delays
// everything by 2.5 s (a proxy's latency), longer than a fetch waits for
// its first message (1 s on the server, one more on the client), as a
// loaded machine or a slow network can; the third fetch finds the link
// fast again. The read goes on and gets every message, once, in order.
// Before, an empty fetch ended the read, and the audit reported every
// event after it as marked sent but missing from the stream.
func TestReadStreamAfterAnEmptyFetch(t *testing.T) {
	ctx := context.Background()
	natsURL := testNATS(t)
	js := natsJS(t, natsURL)
	if _, err := idemnats.EnsureStream(ctx, js, streamConfig(1, 0, slog.New(slog.NewTextHandler(io.Discard, nil)))); err != nil {
		t.Fatal(err)
	}
	const n = auditFetchBatch + 500 // the first fetch gets a full batch
	for i := range n {
		if _, err := js.Publish(ctx, eventSubject, []byte(fmt.Sprintf(`{"n":%d}`, i)), jetstream.WithMsgID(fmt.Sprintf("evt-%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	px := faultproxy.New(t, "audit-read-nats", faultHostPort(t, natsURL))
	slow := natsJS(t, px.URL(natsURL))
	fetches := 0
	var fast func() // removes the latency
	began := time.Now()
	msgs, exists, _, err := readStreamFetching(ctx, slow, new(atomic.Int64), func() {
		switch fetches++; fetches {
		case 2:
			var err error
			if fast, err = px.Latency(faultproxy.Downstream, 2500*time.Millisecond, 0); err != nil {
				t.Fatal(err) // readStreamFetching calls this on the test's goroutine
			}
		case 3:
			fast()
		}
	})
	t.Logf("read %d messages in %d fetches, %v", len(msgs), fetches, time.Since(began).Round(time.Millisecond))
	if err != nil || !exists {
		t.Fatalf("readStream: exists %v, %v", exists, err)
	}
	if len(msgs) != n {
		t.Fatalf("read %d of the stream's %d messages", len(msgs), n)
	}
	for i, m := range msgs {
		if want := fmt.Sprintf("evt-%d", i); m.id != want || m.seq != uint64(i+1) {
			t.Fatalf("message %d: id %s, sequence %d; want %s, %d", i, m.id, m.seq, want, i+1)
		}
	}
}
