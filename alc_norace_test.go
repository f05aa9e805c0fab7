//go:build !race

package idem_test

// The allocations the middleware may add on memstore (see
// TestAlcMiddlewareAllocations), without the race detector.
const (
	alcMaxAddedCreate = 14
	alcMaxAddedReplay = 2
)
