package storetest

import (
	"sync"
	"time"
)

// Clock is a clock that moves only when told, for a store's Options.Now
// and for Harness.NewAt. It is safe for concurrent use.
type Clock struct {
	mu  sync.Mutex // guards now
	now time.Time
}

// NewClock returns a Clock that reads start until it is advanced.
func NewClock(start time.Time) *Clock { return &Clock{now: start} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Advance moves the clock on by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}
