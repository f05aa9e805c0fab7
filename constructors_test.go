package idem_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

// Every constructor checks its arguments when it is called and panics
// with a message that names its own name and the field at fault (doc.go,
// "Programmer errors"); valid arguments, zero values included, build
// without a panic. (NewCompleter returned an error for some of these and
// accepted the rest, such as a negative Interval; NewCleaner took a nil
// sweeper and failed on the first sweep; a lease longer than the TTL was
// accepted, and a key could expire, and run again, under a live attempt.)
func TestConstructorsCheckArguments(t *testing.T) {
	ms := memstore.New(memstore.Options{})
	next := http.NotFoundHandler()
	fn := func(context.Context, []byte) ([]byte, error) { return nil, nil }
	byHeader := func(r *http.Request) string { return r.Header.Get("X-User") }
	bad := []struct {
		name string
		f    func()
		want string // the message's prefix, then a part of it
	}{
		{"middleware lease not shorter than TTL", func() {
			idem.Middleware(ms, idem.Options{User: byHeader, Lease: time.Hour, TTL: time.Second})
		}, "idem.Middleware: |Options.Lease 1h0m0s: not shorter than Options.TTL 1s"},
		{"middleware default lease over a short TTL", func() {
			idem.Middleware(ms, idem.Options{User: byHeader, TTL: 10 * time.Second})
		}, "idem.Middleware: |Options.Lease 30s: not shorter than Options.TTL 10s"},
		{"completer nil store", func() { idem.NewCompleter(nil, next, idem.CompleterOptions{}) }, "idem.NewCompleter: |nil store"},
		{"completer nothing to run", func() { idem.NewCompleter(ms, nil, idem.CompleterOptions{}) }, "idem.NewCompleter: |next is nil"},
		{"completer empty funcs", func() { idem.NewCompleter(ms, nil, idem.CompleterOptions{Funcs: map[string]idem.DoFunc{}}) }, "idem.NewCompleter: |Funcs is empty"},
		{"completer empty operation name", func() { idem.NewCompleter(ms, nil, idem.CompleterOptions{Funcs: map[string]idem.DoFunc{"": fn}}) }, `idem.NewCompleter: |CompleterOptions.Funcs[""]`},
		{"completer operation name with a control character", func() {
			idem.NewCompleter(ms, nil, idem.CompleterOptions{Funcs: map[string]idem.DoFunc{"op\n": fn}})
		}, `idem.NewCompleter: |CompleterOptions.Funcs["op\n"]`},
		{"completer nil function", func() { idem.NewCompleter(ms, nil, idem.CompleterOptions{Funcs: map[string]idem.DoFunc{"op": nil}}) }, `idem.NewCompleter: |CompleterOptions.Funcs["op"]: nil function`},
		{"completer negative interval", func() { idem.NewCompleter(ms, next, idem.CompleterOptions{Interval: -1}) }, "idem.NewCompleter: |CompleterOptions.Interval"},
		{"completer negative max attempts", func() { idem.NewCompleter(ms, next, idem.CompleterOptions{MaxAttempts: -1}) }, "idem.NewCompleter: |CompleterOptions.MaxAttempts"},
		{"completer negative backoff", func() { idem.NewCompleter(ms, next, idem.CompleterOptions{Backoff: -time.Second}) }, "idem.NewCompleter: |CompleterOptions.Backoff"},
		{"completer negative batch", func() { idem.NewCompleter(ms, next, idem.CompleterOptions{Batch: -5}) }, "idem.NewCompleter: |CompleterOptions.Batch"},
		{"completer max backoff under backoff", func() {
			idem.NewCompleter(ms, next, idem.CompleterOptions{Backoff: time.Minute, MaxBackoff: time.Second})
		}, "idem.NewCompleter: |CompleterOptions.MaxBackoff 1s: shorter than Backoff 1m0s"},
		{"completer middleware lease over TTL", func() {
			idem.NewCompleter(ms, next, idem.CompleterOptions{Middleware: idem.Options{Lease: time.Hour, TTL: time.Minute}})
		}, "idem.NewCompleter: |CompleterOptions.Middleware: invalid Options.Lease"},
		{"cleaner nil sweeper", func() { idem.NewCleaner(nil, idem.CleanerOptions{}) }, "idem.NewCleaner: |nil Sweeper"},
		{"cleaner negative interval", func() { idem.NewCleaner(ms, idem.CleanerOptions{Interval: -time.Second}) }, "idem.NewCleaner: |CleanerOptions.Interval"},
		{"cleaner negative pause", func() { idem.NewCleaner(ms, idem.CleanerOptions{Pause: -1}) }, "idem.NewCleaner: |CleanerOptions.Pause"},
		{"cleaner negative batch", func() { idem.NewCleaner(ms, idem.CleanerOptions{Batch: -1}) }, "idem.NewCleaner: |CleanerOptions.Batch"},
	}
	for _, c := range bad {
		t.Run(c.name, func(t *testing.T) {
			prefix, part, _ := strings.Cut(c.want, "|")
			msg := apiPanic(c.f)
			if !strings.HasPrefix(msg, prefix) || !strings.Contains(msg, part) {
				t.Fatalf("panicked with %q; want %q … %q", msg, prefix, part)
			}
		})
	}
	good := []struct {
		name string
		f    func()
	}{
		{"middleware lease under TTL", func() { idem.Middleware(ms, idem.Options{User: byHeader, Lease: time.Minute, TTL: time.Hour}) }},
		{"middleware short lease and TTL", func() { idem.Middleware(ms, idem.Options{User: byHeader, Lease: time.Second, TTL: 2 * time.Second}) }},
		{"completer handler only", func() { idem.NewCompleter(ms, next, idem.CompleterOptions{}) }},
		{"completer functions only", func() { idem.NewCompleter(ms, nil, idem.CompleterOptions{Funcs: map[string]idem.DoFunc{"op": fn}}) }},
		{"completer every field", func() {
			idem.NewCompleter(ms, next, idem.CompleterOptions{Interval: time.Second, MaxAttempts: 3, Backoff: time.Second, MaxBackoff: time.Second, Batch: 1})
		}},
		{"cleaner zero options", func() { idem.NewCleaner(ms, idem.CleanerOptions{}) }},
		{"cleaner every field", func() {
			idem.NewCleaner(ms, idem.CleanerOptions{Interval: time.Second, Batch: 1, Pause: time.Millisecond})
		}},
	}
	for _, c := range good {
		if msg := apiPanic(c.f); msg != "" {
			t.Errorf("%s: panicked with %q", c.name, msg)
		}
	}
}
