package ordersapp

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
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
