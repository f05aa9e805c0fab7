//go:build race

package idem_test

// The allocations the middleware may add on memstore (see
// TestAlcMiddlewareAllocations), with the race detector, which moves more
// values to the heap.
const (
	alcMaxAddedCreate = 15
	alcMaxAddedReplay = 2
)
