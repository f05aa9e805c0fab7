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

type alcKey struct{}

func alcParent(t *testing.T) context.Context {
	t.Helper()
	// A detached parent, as the middleware gives callCtx, of a request
	// that is already canceled: none of it may show through.
	ctx, cancel := context.WithCancel(context.WithValue(context.Background(), alcKey{}, "v"))
	cancel()
	return context.WithoutCancel(ctx)
}

func alcClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// TestAlcCallCtxDeadlineAskedByErr runs in a synctest bubble: the
// deadline passes on its fake clock.
func TestAlcCallCtxDeadlineAskedByErr(t *testing.T) {
	synctest.Test(t, alcCallCtxDeadlineAskedByErr)
}

func alcCallCtxDeadlineAskedByErr(t *testing.T) {
	var c callCtx
	c.init(alcParent(t), 30*time.Millisecond)
	if c.Err() != nil || c.Value(alcKey{}) != "v" || context.Cause(&c) != nil {
		t.Fatalf("at start: err %v, value %v, cause %v", c.Err(), c.Value(alcKey{}), context.Cause(&c))
	}
	time.Sleep(50 * time.Millisecond) // the bubble's fake clock passes the deadline
	if !errors.Is(c.Err(), context.DeadlineExceeded) || !errors.Is(context.Cause(&c), context.DeadlineExceeded) {
		t.Fatalf("past the deadline: %v, cause %v", c.Err(), context.Cause(&c))
	}
	if !alcClosed(c.Done()) || !errors.Is(c.Err(), context.DeadlineExceeded) {
		t.Fatalf("Done after the deadline: closed %v, err %v", alcClosed(c.Done()), c.Err())
	}
	c.stop()
	if !errors.Is(c.Err(), context.DeadlineExceeded) {
		t.Fatalf("stopped after the deadline: %v", c.Err())
	}
}

func TestAlcCallCtxDeadlineAskedByDone(t *testing.T) {
	var c callCtx
	c.init(alcParent(t), 30*time.Millisecond)
	done := c.Done()
	child, stop := context.WithCancel(&c)
	defer stop()
	if alcClosed(done) || child.Err() != nil || child.Value(alcKey{}) != "v" {
		t.Fatalf("at start: closed %v, child %v", alcClosed(done), child.Err())
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

func TestAlcCallCtxStop(t *testing.T) {
	for _, doneFirst := range []bool{false, true} {
		var c callCtx
		c.init(alcParent(t), time.Hour)
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
		if !errors.Is(c.Err(), context.Canceled) || !errors.Is(context.Cause(&c), context.Canceled) || !alcClosed(c.Done()) {
			t.Fatalf("doneFirst %v: after stop: %v, cause %v, closed %v", doneFirst, c.Err(), context.Cause(&c), alcClosed(c.Done()))
		}
		if doneFirst && !errors.Is(child.Err(), context.Canceled) {
			t.Fatalf("child of a stopped context: %v (want canceled at once)", child.Err())
		}
		if c.Value(alcKey{}) != "v" {
			t.Fatal("value lost")
		}
	}
}

func TestAlcDetachedCtx(t *testing.T) {
	parent, cancel := context.WithTimeout(context.WithValue(context.Background(), alcKey{}, "v"), time.Millisecond)
	defer cancel()
	<-parent.Done()
	c := &detachedCtx{parent: parent}
	if _, ok := c.Deadline(); ok || c.Done() != nil || c.Err() != nil {
		t.Fatalf("deadline %v, done %v, err %v", ok, c.Done(), c.Err())
	}
	if c.Value(alcKey{}) != "v" || context.Cause(c) != nil {
		t.Fatalf("value %v, cause %v", c.Value(alcKey{}), context.Cause(c))
	}
	child, stop := context.WithCancel(c)
	if child.Err() != nil {
		t.Fatalf("child of a detached context: %v", child.Err())
	}
	stop()
}
