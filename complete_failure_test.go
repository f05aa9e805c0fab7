package idem_test

import (
	"bytes"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
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
