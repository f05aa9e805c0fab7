package idem

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"
)

// TestAdv2CallCtxErrNeverChanges: once Err returned an error it must
// return the same one (context.Context's contract). A store that keeps the
// claim's context (a goroutine, a connection watcher) and first asks for
// Done after the call returned and after the deadline passed saw
// context.Canceled from Err, then context.DeadlineExceeded. (In a
// synctest bubble: the deadline passes on its fake clock.)
func TestAdv2CallCtxErrNeverChanges(t *testing.T) {
	synctest.Test(t, adv2CallCtxErrNeverChanges)
}

func adv2CallCtxErrNeverChanges(t *testing.T) {
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

// TestAdv2CallCtxDoneAfterDeadline: a store that asks for Done only after
// the deadline passed (the call still running) sees it closed, with
// DeadlineExceeded from Err and Cause; one derived from it too. (In a
// synctest bubble: the deadline passes on its fake clock.)
func TestAdv2CallCtxDoneAfterDeadline(t *testing.T) {
	synctest.Test(t, adv2CallCtxDoneAfterDeadline)
}

func adv2CallCtxDoneAfterDeadline(t *testing.T) {
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
