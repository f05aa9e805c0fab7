//go:build race

package idem_test

// The allocations the middleware may add on memstore (see
// TestMiddlewareAllocations), with the race detector, which moves more
// values to the heap.
const (
	maxAddedAllocsCreate = 14
	maxAddedAllocsReplay = 2
)
