package idem

// The contexts the middleware makes without context.WithTimeout and
// context.WithoutCancel behave as those would (issue 11's allocation
// work): callCtx as context.WithDeadline(parent, deadline) with its
// cancel function called by stop, detachedCtx as context.WithoutCancel.

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

type ctxTestKey struct{}

func canceledDetachedParent(t *testing.T) context.Context {
	t.Helper()
	// A detached parent, as the middleware gives callCtx, of a request
	// that is already canceled: none of it may show through.
	ctx, cancel := context.WithCancel(context.WithValue(context.Background(), ctxTestKey{}, "v"))
	cancel()
	return context.WithoutCancel(ctx)
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// TestCallCtxDeadlineAskedByErr runs in a synctest bubble: the
// deadline passes on its fake clock.
func TestCallCtxDeadlineAskedByErr(t *testing.T) {
	synctest.Test(t, callCtxDeadlineAskedByErr)
}

func callCtxDeadlineAskedByErr(t *testing.T) {
	var c callCtx
	c.init(canceledDetachedParent(t), 30*time.Millisecond)
	if c.Err() != nil || c.Value(ctxTestKey{}) != "v" || context.Cause(&c) != nil {
		t.Fatalf("at start: err %v, value %v, cause %v", c.Err(), c.Value(ctxTestKey{}), context.Cause(&c))
	}
	time.Sleep(50 * time.Millisecond) // the bubble's fake clock passes the deadline
	if !errors.Is(c.Err(), context.DeadlineExceeded) || !errors.Is(context.Cause(&c), context.DeadlineExceeded) {
		t.Fatalf("past the deadline: %v, cause %v", c.Err(), context.Cause(&c))
	}
	if !isClosed(c.Done()) || !errors.Is(c.Err(), context.DeadlineExceeded) {
		t.Fatalf("Done after the deadline: closed %v, err %v", isClosed(c.Done()), c.Err())
	}
	c.stop()
	if !errors.Is(c.Err(), context.DeadlineExceeded) {
		t.Fatalf("stopped after the deadline: %v", c.Err())
	}
}

func TestCallCtxDeadlineAskedByDone(t *testing.T) {
	var c callCtx
	c.init(canceledDetachedParent(t), 30*time.Millisecond)
	done := c.Done()
	child, stop := context.WithCancel(&c)
	defer stop()
	if isClosed(done) || child.Err() != nil || child.Value(ctxTestKey{}) != "v" {
		t.Fatalf("at start: closed %v, child %v", isClosed(done), child.Err())
	}
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Done not closed at the deadline")
	}
	if !errors.Is(c.Err(), context.DeadlineExceeded) || !errors.Is(context.Cause(&c), context.DeadlineExceeded) {
		t.Fatalf("past the deadline: %v, cause %v", c.Err(), context.Cause(&c))
	}
	<-child.Done()
	c.stop()
}

func TestCallCtxStop(t *testing.T) {
	for _, doneFirst := range []bool{false, true} {
		var c callCtx
		c.init(canceledDetachedParent(t), time.Hour)
		d, ok := c.Deadline()
		if !ok || time.Until(d) < 59*time.Minute {
			t.Fatalf("deadline %v %v", d, ok)
		}
		var child context.Context
		if doneFirst {
			c.Done()
			var stop context.CancelFunc
			child, stop = context.WithCancel(&c)
			defer stop()
		}
		c.stop()
		if !errors.Is(c.Err(), context.Canceled) || !errors.Is(context.Cause(&c), context.Canceled) || !isClosed(c.Done()) {
			t.Fatalf("doneFirst %v: after stop: %v, cause %v, closed %v", doneFirst, c.Err(), context.Cause(&c), isClosed(c.Done()))
		}
		if doneFirst && !errors.Is(child.Err(), context.Canceled) {
			t.Fatalf("child of a stopped context: %v (want canceled at once)", child.Err())
		}
		if c.Value(ctxTestKey{}) != "v" {
			t.Fatal("value lost")
		}
	}
}

func TestDetachedCtx(t *testing.T) {
	parent, cancel := context.WithTimeout(context.WithValue(context.Background(), ctxTestKey{}, "v"), time.Millisecond)
	defer cancel()
	<-parent.Done()
	c := &detachedCtx{parent: parent}
	if _, ok := c.Deadline(); ok || c.Done() != nil || c.Err() != nil {
		t.Fatalf("deadline %v, done %v, err %v", ok, c.Done(), c.Err())
	}
	if c.Value(ctxTestKey{}) != "v" || context.Cause(c) != nil {
		t.Fatalf("value %v, cause %v", c.Value(ctxTestKey{}), context.Cause(c))
	}
	child, stop := context.WithCancel(c)
	if child.Err() != nil {
		t.Fatalf("child of a detached context: %v", child.Err())
	}
	stop()
}

// TestCallCtxErrNeverChanges: once Err returned an error it must
// return the same one (context.Context's contract). A store that keeps the
// claim's context (a goroutine, a connection watcher) and first asks for
// Done after the call returned and after the deadline passed saw
// context.Canceled from Err, then context.DeadlineExceeded. (In a
// synctest bubble: the deadline passes on its fake clock.)
func TestCallCtxErrNeverChanges(t *testing.T) {
	synctest.Test(t, callCtxErrNeverChanges)
}

func callCtxErrNeverChanges(t *testing.T) {
	c := new(callCtx)
	c.init(context.WithoutCancel(context.Background()), 5*time.Millisecond)
	c.stop() // the call returned before its deadline
	before := c.Err()
	if !errors.Is(before, context.Canceled) {
		t.Fatalf("Err after stop = %v, want context.Canceled", before)
	}
	time.Sleep(20 * time.Millisecond) // the bubble's fake clock passes the deadline; no timer was made
	select {
	case <-c.Done():
	default:
		t.Fatal("Done not closed after stop")
	}
	if after := c.Err(); after != before { //nolint:errorlint // the same value is the point, not a match
		t.Errorf("Err changed from %v to %v once Done was asked for", before, after)
	}
	if cause := context.Cause(c); cause != before { //nolint:errorlint // the same value is the point, not a match
		t.Errorf("Cause = %v, want %v", cause, before)
	}
}

// TestCallCtxDoneAfterDeadline: a store that asks for Done only after
// the deadline passed (the call still running) sees it closed, with
// DeadlineExceeded from Err and Cause; one derived from it too. (In a
// synctest bubble: the deadline passes on its fake clock.)
func TestCallCtxDoneAfterDeadline(t *testing.T) {
	synctest.Test(t, callCtxDoneAfterDeadline)
}

func callCtxDoneAfterDeadline(t *testing.T) {
	c := new(callCtx)
	c.init(context.WithoutCancel(context.Background()), 5*time.Millisecond)
	defer c.stop()
	time.Sleep(20 * time.Millisecond) // the bubble's fake clock passes the deadline
	select {
	case <-c.Done():
	default:
		t.Fatal("Done not closed after the deadline")
	}
	if err := c.Err(); err != context.DeadlineExceeded { //nolint:errorlint // Context.Err returns the sentinel itself
		t.Errorf("Err = %v, want DeadlineExceeded", err)
	}
	d, cancel := context.WithCancel(c)
	defer cancel()
	select {
	case <-d.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a context derived after the deadline is not done")
	}
	if err := context.Cause(d); err != context.DeadlineExceeded { //nolint:errorlint // Cause without a cause is Err, the sentinel itself
		t.Errorf("derived Cause = %v, want DeadlineExceeded", err)
	}
}
