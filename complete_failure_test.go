package idem_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

// lockedBuffer is a bytes.Buffer for a logger shared by goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// A store that refuses every completion for the same reason (a database
// whose encoding the driver refuses, a full disk): a client retrying one
// key at once, again and again, must not run the handler on every retry
// (each run pays again, then rolls back) nor write a log line per
// attempt. The first attempts end their lease at once, for a blip; then
// the key waits for its lease, as after a crash, and the retries get 409;
// and the error is logged once per interval.
func TestRepeatedCompleteFailureBacksOff(t *testing.T) {
	logs := new(lockedBuffer)
	logger := slog.New(slog.NewTextHandler(logs, nil))
	b := setupStore(t, memstore.New(memstore.Options{}),
		func(s idem.Store) idem.Store { return failingCompleteStore{s.(*memstore.Store)} },
		idem.Options{User: idem.SharedKeySpace, Logger: logger, Lease: time.Hour}, created)
	const retries = 40
	statuses := map[int]int{}
	for range retries {
		r := b.post(t, "k-refused", `{"n":1}`, "X-User", "u1")
		statuses[r.status]++
	}
	runs := b.runs.Load()
	t.Logf("%d requests of one key: answers %v, handler runs %d", retries, statuses, runs)
	if runs > 3 {
		t.Errorf("the handler ran %d times for %d retries of a key whose every completion fails, want at most 3", runs, retries)
	}
	if statuses[http.StatusConflict] < retries-3 {
		t.Errorf("answers %v: want the retries after the first attempts to be 409 while the key waits for its lease", statuses)
	}
	if n := strings.Count(logs.String(), "idem: complete failed"); n != 1 {
		t.Errorf("%d log lines \"complete failed\" for one repeated error, want 1:\n%s", n, logs.String())
	}
	if b.effects.Load() != 0 {
		t.Errorf("%d effects committed without their answer", b.effects.Load())
	}
}

// failingCompleteStore is a memstore whose transactions fail to commit:
// a database that went away between the function and its outcome.
type failingCompleteStore struct{ *memstore.Store }

type failingCompleteTx struct{ idem.Tx }

var errDiskGone = errors.New("disk gone")

func (s failingCompleteStore) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	tx, err := s.Store.Begin(ctx, l)
	if err != nil {
		return nil, err
	}
	return failingCompleteTx{tx}, nil
}

func (tx failingCompleteTx) Complete(ctx context.Context, _ *idemdriver.Response) error {
	tx.Tx.Rollback(ctx)
	return errDiskGone
}

func (tx failingCompleteTx) Unwrap() idem.Tx { return tx.Tx }

// TestDoStoreUnavailable: a store that fails the outcome's commit is
// ErrStoreUnavailable wrapping its error; the function's writes roll back
// and the key stays bound, its attempt ended, for a retry.
func TestDoStoreUnavailable(t *testing.T) {
	ctx := context.Background()
	inner := memstore.New(memstore.Options{})
	s := failingCompleteStore{inner}
	committed := false
	p := idem.DoParams{User: "consumer:test", Key: "unavailable", Operation: "test.unavailable", Input: []byte("input"), Lease: 10 * time.Second, TTL: time.Hour, Logger: slog.New(slog.DiscardHandler)}
	var m idem.Metrics
	p.Metrics = &m
	_, err := idem.Do(ctx, s, p, func(ctx context.Context, _ []byte) ([]byte, error) {
		tx, err := memstore.FromContext(ctx)
		if err != nil {
			return nil, err
		}
		tx.OnCommit(func() { committed = true })
		return []byte("out"), nil
	})
	if !errors.Is(err, idem.ErrStoreUnavailable) || !errors.Is(err, errDiskGone) {
		t.Fatalf("Do = %v, want ErrStoreUnavailable wrapping the store's error", err)
	}
	if committed {
		t.Error("the function's write committed without its outcome")
	}
	rec, err := inner.Get(ctx, p.User, p.Key)
	if err != nil || rec.Response != nil || rec.LeaseUntil.After(time.Now()) {
		t.Errorf("record = %+v, %v; want it bound, no response, lease ended", rec, err)
	}
	if m.StoreErrors.Load() != 1 || m.Failed.Load() != 1 {
		t.Errorf("metrics: %d store errors, %d failed; want 1 and 1", m.StoreErrors.Load(), m.Failed.Load())
	}
	if res, err := idem.Do(ctx, inner, p, func(context.Context, []byte) ([]byte, error) { return []byte("out"), nil }); err != nil || res.Replayed {
		t.Errorf("retry on a working store = %+v, %v", res, err)
	}
}
