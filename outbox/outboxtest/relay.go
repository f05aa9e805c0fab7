package outboxtest

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/outbox"
)

// testRacingRelays runs several relays, each on its own connection pool,
// against adders writing a few keys at once: every key's events are
// published in the order they were added, each exactly once (no publish
// fails here), never two of a key at once, and nothing rolled back is
// published.
func testRacingRelays(t *testing.T, h Harness) {
	const (
		relays    = 4
		keys      = 4
		perKey    = 75 // 300 events
		batch     = 5
		maxPasses = 20000
	)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tables := []outbox.Table{h.Table}
	for len(tables) < relays {
		tables = append(tables, h.Instance(t))
	}
	rec := newRecorder()
	rec.during = func(context.Context, outbox.Event) {
		// Widen the window in which another relay could take the
		// event, or the key's next one.
		for range 50 {
			runtimeGosched()
		}
	}

	var (
		errMu   sync.Mutex
		errs    []error
		addedMu sync.Mutex
		added   = map[string][]string{}
	)
	report := func(err error) {
		errMu.Lock()
		defer errMu.Unlock()
		errs = append(errs, err)
	}
	var adders sync.WaitGroup
	for k := range keys {
		adders.Go(func() {
			key := fmt.Sprintf("user-%d", k)
			for i := 0; i < perKey; {
				// 1 to 3 events per transaction; every fifth
				// transaction, an extra one, rolled back.
				n := min(1+i%3, perKey-i)
				var batchIDs []string
				for j := range n {
					batchIDs = append(batchIDs, fmt.Sprintf("%s-%03d", key, i+j))
				}
				err := h.InTx(ctx, true, func(add func(outbox.Event) error) error {
					for _, id := range batchIDs {
						if err := add(event(id, key)); err != nil {
							return err
						}
					}
					return nil
				})
				if err != nil {
					report(fmt.Errorf("adding %v: %w", batchIDs, err))
					return
				}
				addedMu.Lock()
				added[key] = append(added[key], batchIDs...)
				addedMu.Unlock()
				if i%5 == 0 {
					err := h.InTx(ctx, false, func(add func(outbox.Event) error) error {
						return add(event(fmt.Sprintf("%s-rb-%03d", key, i), key))
					})
					if err != nil {
						report(fmt.Errorf("rolled-back add: %w", err))
						return
					}
				}
				i += n
			}
		})
	}
	addersDone := make(chan struct{})
	go func() { adders.Wait(); close(addersDone) }()

	var relaysWG sync.WaitGroup
	for r, tb := range tables {
		relaysWG.Go(func() {
			for pass := 0; pass < maxPasses; pass++ {
				if ctx.Err() != nil {
					report(fmt.Errorf("relay %d: %w", r, ctx.Err()))
					return
				}
				finished := false
				select {
				case <-addersDone:
					finished = true
				default:
				}
				n, err := tb.Take(ctx, batch, rec.publish)
				if err != nil {
					report(fmt.Errorf("relay %d: Take: %w", r, err))
					return
				}
				if n > batch {
					report(fmt.Errorf("relay %d: Take(limit %d) sent %d", r, batch, n))
				}
				if n == 0 && !finished {
					// Nothing to do yet: pause, as a relay waits for its
					// interval, rather than spin on the database's locks.
					time.Sleep(time.Millisecond)
				}
				if finished && n == 0 {
					left, err := tb.Unsent(ctx)
					if err != nil {
						report(fmt.Errorf("relay %d: Unsent: %w", r, err))
						return
					}
					if left == 0 {
						return
					}
				}
			}
			report(fmt.Errorf("relay %d: still events after %d passes", r, maxPasses))
		})
	}
	relaysWG.Wait()
	for _, err := range errs {
		t.Error(err)
	}
	order, count, problems := rec.snapshot()
	for _, p := range problems {
		t.Error(p)
	}
	total := 0
	for key, want := range added {
		total += len(want)
		if got := order[key]; !slices.Equal(got, want) {
			t.Errorf("key %s: published %d events in the order %v, want %d in %v", key, len(got), got, len(want), want)
		}
	}
	if total != keys*perKey {
		t.Errorf("added %d events, want %d", total, keys*perKey)
	}
	for id, c := range count {
		if c != 1 {
			t.Errorf("event %s published %d times, want once", id, c)
		}
	}
	if len(count) != total {
		t.Errorf("published %d distinct events, want %d (rolled-back ones must not be)", len(count), total)
	}
	if n := unsent(t, h.Table); n != 0 {
		t.Errorf("Unsent = %d, want 0", n)
	}
}

var errBroker = errors.New("broker refused")

func testFailedPublish(t *testing.T, h Harness) {
	ctx := context.Background()
	add(t, h, event("a1", "A"), event("b1", "B"))
	add(t, h, event("a2", "A"), event("b2", "B"))
	rec := newRecorder()
	rec.setFail(func(e outbox.Event) error {
		if e.ID == "a1" {
			return errBroker
		}
		return nil
	})
	for pass := range 4 {
		n, err := h.Table.Take(ctx, 10, rec.publish)
		if !errors.Is(err, errBroker) {
			t.Fatalf("pass %d: Take = %d, %v; want the publisher's error", pass, n, err)
		}
		if want := []int{2, 0, 0, 0}[pass]; n != want {
			t.Errorf("pass %d: Take sent %d, want %d", pass, n, want)
		}
	}
	order, _, _ := rec.snapshot()
	if got := order["B"]; !slices.Equal(got, []string{"b1", "b2"}) {
		t.Errorf("key B published %v, want [b1 b2] while A is stuck", got)
	}
	if got := order["A"]; len(got) != 0 {
		t.Errorf("key A published %v while a1 fails, want nothing", got)
	}
	if n := unsent(t, h.Table); n != 2 {
		t.Errorf("Unsent = %d, want 2 (a1, a2)", n)
	}
	rec.setFail(nil)
	relay := outbox.NewRelay(h.Table, outbox.PublishFunc(rec.publish), outbox.RelayOptions{Batch: 10})
	if n, err := relay.RunOnce(ctx); n != 2 || err != nil {
		t.Fatalf("RunOnce after the broker healed = %d, %v; want 2, nil", n, err)
	}
	order, _, _ = rec.snapshot()
	if got := order["A"]; !slices.Equal(got, []string{"a1", "a2"}) {
		t.Errorf("key A published %v, want [a1 a2]", got)
	}
}

// testStuckKeyBacklog: a key whose oldest event keeps failing, with a
// backlog larger than a batch ahead of the other keys' events, holds back
// only itself.
func testStuckKeyBacklog(t *testing.T, h Harness) {
	var stuck []outbox.Event
	for i := range 30 {
		stuck = append(stuck, event(fmt.Sprintf("stuck-%02d", i), "stuck"))
	}
	add(t, h, stuck...)
	add(t, h, event("o1", "o1"), event("o2", "o2"), event("o3", "o3"))
	rec := newRecorder()
	rec.setFail(func(e outbox.Event) error {
		if e.OrderingKey == "stuck" {
			return errBroker
		}
		return nil
	})
	relay := outbox.NewRelay(h.Table, outbox.PublishFunc(rec.publish), outbox.RelayOptions{Batch: 5})
	n, err := relay.RunOnce(context.Background())
	if n != 3 || !errors.Is(err, errBroker) {
		t.Fatalf("RunOnce = %d, %v; want 3 and the publisher's error", n, err)
	}
	_, count, _ := rec.snapshot()
	for _, id := range []string{"o1", "o2", "o3"} {
		if count[id] != 1 {
			t.Errorf("%s published %d times, want once", id, count[id])
		}
	}
	if got := unsent(t, h.Table); got != 30 {
		t.Errorf("Unsent = %d, want 30", got)
	}
	rec.mu.Lock()
	calls := rec.calls
	rec.mu.Unlock()
	if calls != 3+2 { // o1..o3, and stuck-00 once in each of the two passes
		t.Errorf("publish called %d times, want 5: a key's later events are not tried after its failure", calls)
	}
}

// testCrashBeforeMark: the broker has the events but the pass ends before
// its commit; the next pass publishes them again, with the same IDs, and
// in order.
func testCrashBeforeMark(t *testing.T, h Harness) {
	add(t, h, event("x1", "X"), event("y1", "Y"))
	add(t, h, event("x2", "X"))
	rec := newRecorder()
	passCtx, crash := context.WithCancel(context.Background())
	defer crash()
	rec.during = func(_ context.Context, e outbox.Event) {
		if e.ID == "x1" {
			crash() // the process dies once the broker acknowledged x1
		}
	}
	n, err := h.Table.Take(passCtx, 10, rec.publish)
	if err == nil || n != 0 {
		t.Fatalf("Take whose ctx ended before the commit = %d, %v; want 0 and an error", n, err)
	}
	if got := unsent(t, h.Table); got != 3 {
		t.Fatalf("Unsent after the crash = %d, want 3", got)
	}
	rec.during = nil
	relay := outbox.NewRelay(h.Table, outbox.PublishFunc(rec.publish), outbox.RelayOptions{})
	if n, err := relay.RunOnce(context.Background()); n != 3 || err != nil {
		t.Fatalf("RunOnce after the crash = %d, %v; want 3, nil", n, err)
	}
	order, count, _ := rec.snapshot()
	if got, want := order["X"], []string{"x1", "x1", "x2"}; !slices.Equal(got, want) {
		t.Errorf("key X published %v, want %v (x1 again, same ID, before x2)", got, want)
	}
	if count["y1"] != 1 {
		t.Errorf("y1 published %d times, want once (the crashed pass had stopped before it)", count["y1"])
	}
	if got := unsent(t, h.Table); got != 0 {
		t.Errorf("Unsent = %d, want 0", got)
	}
}

// testPublishDeadline: publish gets a ctx with a deadline.
func testPublishDeadline(t *testing.T, h Harness) {
	add(t, h, event("d1", "D"))
	var (
		has bool
		in  time.Duration
	)
	n, err := h.Table.Take(context.Background(), 1, func(ctx context.Context, _ outbox.Event) error {
		var dl time.Time
		dl, has = ctx.Deadline()
		in = time.Until(dl)
		return nil
	})
	if n != 1 || err != nil {
		t.Fatalf("Take = %d, %v; want 1, nil", n, err)
	}
	if !has || in <= 0 || in > outbox.DefaultPublishTimeout {
		t.Errorf("publish's ctx: deadline %v (set %v), want one within DefaultPublishTimeout", in, has)
	}
}

func testEachUnsent(t *testing.T, h Harness) {
	ctx := context.Background()
	var want []string
	for i := range 7 {
		id := fmt.Sprintf("ev-%d", i)
		want = append(want, id)
		add(t, h, event(id, fmt.Sprintf("key-%d", i%2)))
	}
	if n := unsent(t, h.Table); n != 7 {
		t.Fatalf("Unsent = %d, want 7", n)
	}
	// A pass of 2 sends the oldest two: ev-0 and ev-1.
	if n, err := h.Table.Take(ctx, 2, func(context.Context, outbox.Event) error { return nil }); n != 2 || err != nil {
		t.Fatalf("Take = %d, %v; want 2, nil", n, err)
	}
	es, sent := all(t, h.Table)
	if got := ids(es); !slices.Equal(got, want) {
		t.Fatalf("Each: %v, want %v (oldest first)", got, want)
	}
	for i, at := range sent {
		if wantSent := i < 2; at.IsZero() == wantSent {
			t.Errorf("Each: %s sentAt %v, want sent %v", es[i].ID, at, wantSent)
		}
	}
	if n := unsent(t, h.Table); n != 5 {
		t.Errorf("Unsent = %d, want 5", n)
	}
	stop := errors.New("stop")
	calls := 0
	err := h.Table.Each(ctx, func(outbox.Event, time.Time) error {
		calls++
		if calls == 3 {
			return stop
		}
		return nil
	})
	if !errors.Is(err, stop) || calls != 3 {
		t.Errorf("Each with fn failing on the 3rd = %v after %d calls, want %v after 3", err, calls, stop)
	}
}

func testRelay(t *testing.T, h Harness) {
	add(t, h, event("r1", "R"))
	rec := newRecorder()
	var (
		passMu sync.Mutex
		passes int
	)
	relay := outbox.NewRelay(h.Table, outbox.PublishFunc(rec.publish), outbox.RelayOptions{
		Interval: time.Hour, // only the first round and Kicks
		OnPass: func(int, error) {
			passMu.Lock()
			defer passMu.Unlock()
			passes++
		},
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); relay.Run(ctx) }()
	published := func(id string) func() bool {
		return func() bool { _, count, _ := rec.snapshot(); return count[id] == 1 }
	}
	waitUntil(t, "r1 published by Run's first round", published("r1"))
	add(t, h, event("r2", "R"))
	relay.Kick()
	waitUntil(t, "r2 published after Kick", published("r2"))
	cancel()
	<-done
	order, _, _ := rec.snapshot()
	if got := order["R"]; !slices.Equal(got, []string{"r1", "r2"}) {
		t.Errorf("published %v, want [r1 r2]", got)
	}
	passMu.Lock()
	defer passMu.Unlock()
	if passes < 2 {
		t.Errorf("OnPass called %d times, want at least 2", passes)
	}
}

// testRunOnceError: an event that keeps failing does not stop RunOnce
// from draining the other keys, batch after batch; its error is returned.
func testRunOnceError(t *testing.T, h Harness) {
	add(t, h, event("bad", "poisoned"))
	for i := range 5 {
		add(t, h, event(fmt.Sprintf("ok-%d", i), fmt.Sprintf("key-%d", i)))
	}
	relay := outbox.NewRelay(h.Table, outbox.PublishFunc(func(_ context.Context, e outbox.Event) error {
		if e.ID == "bad" {
			return errBroker
		}
		return nil
	}), outbox.RelayOptions{Batch: 2})
	n, err := relay.RunOnce(context.Background())
	if n != 5 || !errors.Is(err, errBroker) {
		t.Fatalf("RunOnce = %d, %v; want 5 and the publisher's error", n, err)
	}
	if got := unsent(t, h.Table); got != 1 {
		t.Errorf("Unsent = %d, want 1", got)
	}
}
