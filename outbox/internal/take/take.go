// Package take holds what the outbox's tables share in Add and Take:
// checking an event, ordering a batch by sequence, and publishing it under
// one deadline.
package take

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/idem-go/idem/outbox"
)

// Prepare checks e and fills in its defaults, as Add stores it.
func Prepare(e outbox.Event, now time.Time) (outbox.Event, error) {
	if e.ID == "" {
		return e, errors.New("outbox: Add: the event has no ID")
	}
	if e.Subject == "" {
		return e, fmt.Errorf("outbox: Add %s: the event has no subject", e.ID)
	}
	if e.CreatedAt.IsZero() {
		e.CreatedAt = now
	}
	if e.Body == nil {
		e.Body = []byte{}
	}
	return e, nil
}

// Seq is an event with its place in the table's order.
type Seq struct {
	outbox.Event
	Seq int64
}

// InOrder returns es's events ordered by seq: each key's oldest unsent
// event (its head) comes before the ones that follow it.
func InOrder(es []Seq) []outbox.Event {
	slices.SortFunc(es, func(a, b Seq) int { return cmp.Compare(a.Seq, b.Seq) })
	out := make([]outbox.Event, len(es))
	for i, e := range es {
		out[i] = e.Event
	}
	return out
}

// PublishAll calls publish for each of events, in order, with a ctx that
// ends timeout from now, and returns the IDs it attempted, those that were
// published, and the failures joined. After a key's event failed, the
// key's later events are not attempted in this pass. Once that ctx ends
// (the broker is slow, or ctx ended), it attempts no more: those events
// are left for the next pass.
func PublishAll(ctx context.Context, timeout time.Duration, events []outbox.Event,
	publish func(ctx context.Context, e outbox.Event) error,
) (attempted, sent []string, err error) {
	pctx, cancel := context.WithTimeout(ctx, publishTimeout(timeout))
	defer cancel()
	var errs []error
	failed := make(map[string]bool) // keys whose event failed in this pass
	for i, e := range events {
		if cerr := pctx.Err(); cerr != nil {
			errs = append(errs, fmt.Errorf("outbox: %d events left for the next pass: %w", len(events)-i, cerr))
			break
		}
		if failed[e.OrderingKey] {
			continue
		}
		attempted = append(attempted, e.ID)
		if perr := publish(pctx, e); perr != nil {
			failed[e.OrderingKey] = true
			// The body stays out of the error: it may hold personal data.
			errs = append(errs, fmt.Errorf("outbox: publish %s (subject %s): %w", e.ID, e.Subject, perr))
			continue
		}
		sent = append(sent, e.ID)
	}
	return attempted, sent, errors.Join(errs...)
}

// publishTimeout returns d, or outbox.DefaultPublishTimeout when d is not
// positive.
func publishTimeout(d time.Duration) time.Duration {
	if d <= 0 {
		return outbox.DefaultPublishTimeout
	}
	return d
}

// EachPage is how many events Each reads per query: a long audit does not
// hold one read transaction open for the whole table.
const EachPage = 500
