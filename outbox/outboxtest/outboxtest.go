// Package outboxtest is the suite every outbox table passes: Run it from a
// test of the table's package with a Harness on a fresh database.
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

// Harness is one migrated, empty outbox table of a test's own.
type Harness struct {
	// Table is the table under test.
	Table outbox.Table
	// InTx runs fn in a new transaction of the table's database, add
	// being the table's Add on that transaction. When fn returns nil the
	// transaction commits if commit is set and rolls back if not; when fn
	// fails it rolls back, and InTx returns fn's error.
	InTx func(ctx context.Context, commit bool, fn func(add func(outbox.Event) error) error) error
	// Instance opens the same table again, as another process would (its
	// own connection pool), closed when t ends.
	Instance func(t *testing.T) outbox.Table
}

// Run runs the suite; newHarness is called once per test.
func Run(t *testing.T, newHarness func(t *testing.T) Harness) {
	tests := []struct {
		name string
		fn   func(t *testing.T, h Harness)
	}{
		{"AddCommitRollback", testAddCommitRollback},
		{"AddDefaults", testAddDefaults},
		{"Exists", testExists},
		{"OrderOneRelay", testOrderOneRelay},
		{"OneKeyBatch", testOneKeyBatch},
		{"RacingRelays", testRacingRelays},
		{"FailedPublishBlocksItsKeyOnly", testFailedPublish},
		{"StuckKeyBacklog", testStuckKeyBacklog},
		{"CrashBeforeMark", testCrashBeforeMark},
		{"PublishDeadline", testPublishDeadline},
		{"EachUnsent", testEachUnsent},
		{"Relay", testRelay},
		{"RunOnceError", testRunOnceError},
		{"DeleteSent", testDeleteSent},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { tt.fn(t, newHarness(t)) })
	}
}

// add adds es in one committed transaction, or fails t.
func add(t *testing.T, h Harness, es ...outbox.Event) {
	t.Helper()
	err := h.InTx(context.Background(), true, func(add func(outbox.Event) error) error {
		for _, e := range es {
			if err := add(e); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("adding %d events: %v", len(es), err)
	}
}

func event(id, key string) outbox.Event {
	return outbox.Event{ID: id, Subject: "test.events", OrderingKey: key, Body: []byte(`{"id":"` + id + `"}`)}
}

// all returns every event with its sent time, oldest first.
func all(t *testing.T, tb outbox.Table) (es []outbox.Event, sent []time.Time) {
	t.Helper()
	err := tb.Each(context.Background(), func(e outbox.Event, at time.Time) error {
		es = append(es, e)
		sent = append(sent, at)
		return nil
	})
	if err != nil {
		t.Fatalf("Each: %v", err)
	}
	return es, sent
}

func ids(es []outbox.Event) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.ID)
	}
	return out
}

func unsent(t *testing.T, tb outbox.Table) int {
	t.Helper()
	n, err := tb.Unsent(context.Background())
	if err != nil {
		t.Fatalf("Unsent: %v", err)
	}
	return n
}

// recorder is a publisher that records what it was given, checks that no
// event and no key is published by two callers at once, and fails the
// events fail says to.
type recorder struct {
	mu       sync.Mutex          // guards the fields below
	order    map[string][]string // ordering key → IDs in the order published
	count    map[string]int      // ID → successful publishes
	calls    int                 // publish calls
	inFlight map[string]bool     // IDs being published
	keyBusy  map[string]bool     // keys with an event being published
	problems []string            // overlaps seen
	fail     func(e outbox.Event) error
	// during, if set, runs while the event and its key are marked in
	// flight (outside mu).
	during func(ctx context.Context, e outbox.Event)
}

func newRecorder() *recorder {
	return &recorder{
		order: map[string][]string{}, count: map[string]int{},
		inFlight: map[string]bool{}, keyBusy: map[string]bool{},
	}
}

func (r *recorder) publish(ctx context.Context, e outbox.Event) error {
	r.mu.Lock()
	r.calls++
	if r.inFlight[e.ID] {
		r.problems = append(r.problems, "event "+e.ID+" published by two relays at once")
	}
	if r.keyBusy[e.OrderingKey] {
		r.problems = append(r.problems, "key "+e.OrderingKey+" has two events in flight at once ("+e.ID+")")
	}
	r.inFlight[e.ID], r.keyBusy[e.OrderingKey] = true, true
	fail := r.fail
	r.mu.Unlock()

	if r.during != nil {
		r.during(ctx, e)
	}
	var err error
	if fail != nil {
		err = fail(e)
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.inFlight, e.ID)
	delete(r.keyBusy, e.OrderingKey)
	if err != nil {
		return err
	}
	r.order[e.OrderingKey] = append(r.order[e.OrderingKey], e.ID)
	r.count[e.ID]++
	return nil
}

func (r *recorder) setFail(f func(e outbox.Event) error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fail = f
}

func (r *recorder) snapshot() (order map[string][]string, count map[string]int, problems []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	order = map[string][]string{}
	for k, v := range r.order {
		order[k] = slices.Clone(v)
	}
	count = map[string]int{}
	for k, v := range r.count {
		count[k] = v
	}
	return order, count, slices.Clone(r.problems)
}

func testAddCommitRollback(t *testing.T, h Harness) {
	ctx := context.Background()
	err := h.InTx(ctx, false, func(add func(outbox.Event) error) error { return add(event("rolled-back", "k")) })
	if err != nil {
		t.Fatalf("InTx (rollback): %v", err)
	}
	if n := unsent(t, h.Table); n != 0 {
		t.Fatalf("after a rollback: Unsent = %d, want 0", n)
	}
	boom := errors.New("handler failed")
	err = h.InTx(ctx, true, func(add func(outbox.Event) error) error {
		if err := add(event("failed-handler", "k")); err != nil {
			return err
		}
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("InTx with a failing fn = %v, want %v", err, boom)
	}
	add(t, h, event("committed", "k"))
	es, sent := all(t, h.Table)
	if got, want := ids(es), []string{"committed"}; !slices.Equal(got, want) {
		t.Fatalf("events = %v, want %v", got, want)
	}
	if !sent[0].IsZero() {
		t.Errorf("sentAt of a new event = %v, want zero", sent[0])
	}
	if n := unsent(t, h.Table); n != 1 {
		t.Errorf("Unsent = %d, want 1", n)
	}
	rec := newRecorder()
	n, err := h.Table.Take(ctx, 10, rec.publish)
	if n != 1 || err != nil {
		t.Fatalf("Take = %d, %v; want 1, nil", n, err)
	}
	if _, count, _ := rec.snapshot(); count["committed"] != 1 || len(count) != 1 {
		t.Errorf("published %v, want committed once", count)
	}
}

func testAddDefaults(t *testing.T, h Harness) {
	ctx := context.Background()
	for _, e := range []outbox.Event{{Subject: "s"}, {ID: "no-subject"}} {
		err := h.InTx(ctx, false, func(add func(outbox.Event) error) error { return add(e) })
		if err == nil {
			t.Errorf("Add(%+v) = nil, want an error", e)
		}
	}
	before := time.Now().Add(-time.Second)
	created := time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC)
	add(t, h,
		outbox.Event{ID: "defaults", Subject: "s"},
		outbox.Event{ID: "given", Subject: "s.t", OrderingKey: "u1", Body: []byte{0, 1, 2, 0xff}, CreatedAt: created})
	es, _ := all(t, h.Table)
	if len(es) != 2 {
		t.Fatalf("Each: %d events, want 2", len(es))
	}
	if d := es[0]; d.ID != "defaults" || d.OrderingKey != "" || len(d.Body) != 0 || d.CreatedAt.Before(before) || d.CreatedAt.After(time.Now().Add(time.Second)) {
		t.Errorf("event with defaults read back as %+v", d)
	}
	g := es[1]
	if g.ID != "given" || g.Subject != "s.t" || g.OrderingKey != "u1" || string(g.Body) != "\x00\x01\x02\xff" || !g.CreatedAt.Equal(created) {
		t.Errorf("event read back as %+v, want it as added (created %v)", g, created)
	}
}

func testExists(t *testing.T, h Harness) {
	ctx := context.Background()
	add(t, h, event("e1", "k"))
	// Repeated in a later transaction: ErrExists, and the caller's
	// transaction goes on (Add neither ends nor breaks it).
	err := h.InTx(ctx, true, func(add func(outbox.Event) error) error {
		if err := add(event("e1", "k")); !errors.Is(err, outbox.ErrExists) {
			return fmt.Errorf("add of an existing id = %v, want ErrExists", err)
		}
		return add(event("e2", "k"))
	})
	if err != nil {
		t.Fatal(err)
	}
	// Repeated within one transaction.
	err = h.InTx(ctx, true, func(add func(outbox.Event) error) error {
		if err := add(event("e3", "k")); err != nil {
			return err
		}
		if err := add(event("e3", "other")); !errors.Is(err, outbox.ErrExists) {
			return fmt.Errorf("second Add of e3 in one tx = %v, want ErrExists", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	es, _ := all(t, h.Table)
	if got, want := ids(es), []string{"e1", "e2", "e3"}; !slices.Equal(got, want) {
		t.Fatalf("events = %v, want %v", got, want)
	}
	if es[2].OrderingKey != "k" {
		t.Errorf("e3's key = %q, want the first Add's %q", es[2].OrderingKey, "k")
	}
}

func testOrderOneRelay(t *testing.T, h Harness) {
	ctx := context.Background()
	var want []string
	for i := range 10 {
		id := fmt.Sprintf("k-%02d", i)
		want = append(want, id)
		add(t, h, event(id, "k"), event(fmt.Sprintf("solo-%02d", i), fmt.Sprintf("solo-%02d", i)))
	}
	rec := newRecorder()
	passes := 0
	for ; passes < 100; passes++ {
		n, err := h.Table.Take(ctx, 3, func(ctx context.Context, e outbox.Event) error {
			return rec.publish(ctx, e)
		})
		if err != nil {
			t.Fatalf("Take: %v", err)
		}
		if n > 3 {
			t.Fatalf("Take(limit 3) sent %d", n)
		}
		if n == 0 {
			break
		}
	}
	order, count, _ := rec.snapshot()
	if got := order["k"]; !slices.Equal(got, want) {
		t.Errorf("key k published as %v, want %v", got, want)
	}
	if len(count) != 20 {
		t.Errorf("published %d distinct events, want 20", len(count))
	}
	if n := unsent(t, h.Table); n != 0 {
		t.Errorf("Unsent = %d after %d passes, want 0", n, passes)
	}
}

// testOneKeyBatch: a pass sends a batch of one key's events, in order.
func testOneKeyBatch(t *testing.T, h Harness) {
	ctx := context.Background()
	var want []string
	for i := range 10 {
		id := fmt.Sprintf("one-%02d", i)
		want = append(want, id)
		add(t, h, event(id, "one"))
	}
	rec := newRecorder()
	for pass, wantN := range []int{4, 4, 2, 0} {
		if n, err := h.Table.Take(ctx, 4, rec.publish); n != wantN || err != nil {
			t.Fatalf("pass %d: Take(limit 4) = %d, %v; want %d, nil", pass, n, err, wantN)
		}
	}
	if order, _, _ := rec.snapshot(); !slices.Equal(order["one"], want) {
		t.Errorf("published %v, want %v", order["one"], want)
	}
}

// testDeleteSent: DeleteSent deletes sent events sent before its time, by
// at most limit at a time, and never an unsent one, however old.
func testDeleteSent(t *testing.T, h Harness) {
	sw, ok := h.Table.(outbox.Sweeper)
	if !ok {
		t.Fatalf("%T does not implement outbox.Sweeper", h.Table)
	}
	ctx := context.Background()
	add(t, h, event("s1", "a"), event("s2", "a"), event("s3", "b"))
	rec := newRecorder()
	if n, err := h.Table.Take(ctx, 10, rec.publish); err != nil || n != 3 {
		t.Fatalf("Take = %d, %v; want 3, nil", n, err)
	}
	old := event("u1", "c")
	old.CreatedAt = time.Now().Add(-24 * time.Hour)
	add(t, h, old)

	if _, err := sw.DeleteSent(ctx, time.Now(), 0); err == nil {
		t.Error("DeleteSent with limit 0 succeeded, want an error")
	}
	// The events were marked sent by the database's clock, which may
	// differ a little from this process's: a minute either way.
	if n, err := sw.DeleteSent(ctx, time.Now().Add(-time.Minute), 10); err != nil || n != 0 {
		t.Errorf("DeleteSent(a minute ago) = %d, %v; want 0, nil", n, err)
	}
	later := time.Now().Add(time.Minute)
	var deleted []int
	for range 4 {
		n, err := sw.DeleteSent(ctx, later, 2)
		if err != nil {
			t.Fatal(err)
		}
		deleted = append(deleted, n)
	}
	if !slices.Equal(deleted, []int{2, 1, 0, 0}) {
		t.Errorf("DeleteSent(in a minute, 2) four times deleted %v, want [2 1 0 0]", deleted)
	}
	es, sent := all(t, h.Table)
	if got := ids(es); len(got) != 1 || got[0] != "u1" || !sent[0].IsZero() {
		t.Errorf("after the sweep the table holds %v (sent at %v), want just u1, unsent", got, sent)
	}
	// The unsent event is still published, once.
	if n, err := h.Table.Take(ctx, 10, rec.publish); err != nil || n != 1 {
		t.Fatalf("Take after the sweep = %d, %v; want 1, nil", n, err)
	}
	if _, count, problems := rec.snapshot(); count["u1"] != 1 || count["s1"] != 1 || len(problems) > 0 {
		t.Errorf("published %v (problems %v), want each event once", count, problems)
	}
}
