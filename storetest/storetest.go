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

// Run runs the conformance suite against the stores h makes.
func Run(t *testing.T, h Harness) {
	tests := []struct {
		name string
		fn   func(*testing.T, Harness)
	}{
		{"SequentialReplay", testSequentialReplay},
		{"Mismatch", testMismatch},
		{"InFlight", testInFlight},
		{"ConcurrentClaims", testConcurrentClaims},
		{"ConcurrentRetriesExecuteOnce", testConcurrentRetriesExecuteOnce},
		{"LeaseTakeover", testLeaseTakeover},
		{"FencedAttemptCannotCommit", testFenced},
		{"ReleaseFreesKey", testRelease},
		{"FailKeepsFingerprint", testFail},
		{"CompleteWithoutResponseFreesKey", testCompleteNil},
		{"RollbackCommitsNothing", testRollback},
		{"Expiry", testExpiry},
		{"UserScope", testUserScope},
		{"RecordKeepsRequest", testRecordKeepsRequest},
		{"Sweeper", testSweeper},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.fn(t, h)
		})
	}
}
