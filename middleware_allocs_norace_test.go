//go:build !race

package idem_test

// The allocations the middleware may add on memstore (see
// TestMiddlewareAllocations), without the race detector.
const (
	maxAddedAllocsCreate = 13
	maxAddedAllocsReplay = 2
)
