// Package storetest is the conformance suite every idem.Store passes.
//
// A store's test calls Run with a Harness that makes fresh stores and lets
// the suite write a side effect through a store's transaction, as a handler
// would, and count the effects that committed.
package storetest

import (
	"context"
	"testing"

	"github.com/idem-go/idem"
)

// Harness adapts a store to the suite.
type Harness struct {
	// New returns a fresh, empty store; the suite's tests may run in
	// parallel, so each call must return an independent store.
	New func(t *testing.T) idem.Store
	// Write records a side effect named name through tx, as a handler's
	// write would be.
	Write func(ctx context.Context, tx idem.Tx, name string) error
	// Count reports how many committed side effects named name store holds.
	Count func(ctx context.Context, store idem.Store, name string) (int, error)
}
