package benchkit

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// HoldHeader marks a request that the Target's handler holds: while a
// Gate is open on the Target (Target.Hold), a request carrying this
// header (any non-empty value) waits inside the handler, before its
// INSERT, until the Gate is released, its bound passes or the request's
// context ends. Behind the middleware the request has claimed its key by
// then, so other requests with the same key find it in flight. Without an
// open Gate the header does nothing.
const HoldHeader = "X-Bench-Hold"

// Gate holds the requests that carry HoldHeader; see Target.Hold.
type Gate struct {
	t       *Target
	max     time.Duration
	open    chan struct{} // closed by Release
	once    sync.Once
	poke    chan struct{} // a request entered or left
	entered atomic.Int64
	left    atomic.Int64
}

// Hold opens a Gate on t: from now on the handler holds each request that
// carries HoldHeader, for at most max (so that a Gate nobody releases
// frees its requests anyway), until the Gate is released. A Gate already
// open on t is released first. Close releases the open Gate too.
func (t *Target) Hold(max time.Duration) *Gate {
	g := &Gate{t: t, max: max, open: make(chan struct{}), poke: make(chan struct{}, 1)}
	if old := t.gate.Swap(g); old != nil {
		old.Release()
	}
	return g
}

// Release lets every held request go on (they INSERT and answer) and
// closes the Gate: later requests are not held. It may be called more
// than once.
func (g *Gate) Release() {
	g.once.Do(func() {
		g.t.gate.CompareAndSwap(g, nil)
		close(g.open)
	})
}

// Entered returns how many requests the Gate has held so far.
func (g *Gate) Entered() int64 { return g.entered.Load() }

// Inside returns how many requests the Gate holds now.
func (g *Gate) Inside() int64 { return g.entered.Load() - g.left.Load() }

// WaitEntered waits until the Gate has held n requests, or ctx ends.
func (g *Gate) WaitEntered(ctx context.Context, n int64) error {
	return g.waitFor(ctx, func() bool { return g.entered.Load() >= n })
}

// WaitEmpty waits until every request the Gate held has left it, or ctx
// ends. Call it after Release.
func (g *Gate) WaitEmpty(ctx context.Context) error {
	return g.waitFor(ctx, func() bool { return g.Inside() == 0 })
}

func (g *Gate) waitFor(ctx context.Context, done func() bool) error {
	for !done() {
		select {
		case <-g.poke:
		case <-time.After(50 * time.Millisecond): // a poke may go to another waiter
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

func (g *Gate) signal() {
	select {
	case g.poke <- struct{}{}:
	default:
	}
}

// hold keeps r inside the handler while t's Gate is open, if r asks for it.
func (t *Target) hold(r *http.Request) {
	if r.Header.Get(HoldHeader) == "" {
		return
	}
	g := t.gate.Load()
	if g == nil {
		return
	}
	g.entered.Add(1)
	g.signal()
	timer := time.NewTimer(g.max)
	select {
	case <-g.open:
	case <-timer.C:
	case <-r.Context().Done():
	}
	timer.Stop()
	g.left.Add(1)
	g.signal()
}
