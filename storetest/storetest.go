// Package storetest is the conformance suite every idem.Store passes.
//
// A store's test calls Run with a Harness that makes fresh stores and lets
// the suite write a side effect through a store's transaction, as a handler
// would, and count the effects that committed. A harness that can also set
// a store's clock (NewAt) gets the cases that check exact times and the
// boundaries of leases and expiry.
package storetest

import (
	"context"
	"testing"
	"time"

	"github.com/idem-go/idem"
)

// Harness adapts a store to the suite.
type Harness struct {
	// New returns a fresh, empty store; the suite's tests may run in
	// parallel, so each call must return an independent store.
	New func(t *testing.T) idem.Store
	// Write records a side effect named name through tx, as a handler's
	// write would be. tx is what the store's Begin returned, or what
	// idem.TxFromContext returns in a handler, which may wrap it: reach
	// the store's own with idemdriver.UnwrapTx.
	Write func(ctx context.Context, tx idem.Tx, name string) error
	// Count reports how many committed side effects named name store holds.
	Count func(ctx context.Context, store idem.Store, name string) (int, error)
	// NewAt, if set, returns a fresh store like New whose clock is now
	// instead of the wall clock. The cases that check exact times and the
	// boundaries of leases and expiry use it, and skip without it. Their
	// clock starts at a whole second and moves by whole microseconds or
	// by a nanosecond just short of a boundary, so a store may truncate
	// its times to the microsecond (but not round them).
	NewAt func(t *testing.T, now func() time.Time) idem.Store
	// HandlerCommit and HandlerRollback, if set, call the method that
	// would commit, or roll back, the transaction a handler reaches through
	// the store's own accessor (its FromContext) in ctx, a claimed
	// request's context (pgx.Tx's Commit and Rollback; those of
	// sqlitestore.HandlerTx; memstore.Tx's Complete and Rollback), and
	// return its error. The case HandlerCannotEndTx checks that they are
	// refused; without them it checks idem.TxFromContext's Tx alone.
	HandlerCommit, HandlerRollback func(ctx context.Context) error
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
		{"CompleteDropsRequestBody", testCompleteDropsRequestBody},
		{"Sweeper", testSweeper},
		{"TxLifecycle", testTxLifecycle},
		{"NilAndEmptyValuesRoundTrip", testRoundTrip},
		{"CanceledContext", testCanceledContext},
		{"ConcurrentTakeover", testConcurrentTakeover},
		{"ClaimResend", testClaimResend},
		{"HandlerCannotEndTx", testHandlerCannotEndTx},
		// The cases below need Harness.NewAt.
		{"ClaimTimes", testClaimTimes},
		{"ReplayAfterLease", testReplayAfterLease},
		{"LeaseBoundary", testLeaseBoundary},
		{"FailEndsLeaseNow", testFailEndsLeaseNow},
		{"ExpiryBoundary", testExpiryBoundary},
		{"ExpiryWhileLeased", testExpiryWhileLeased},
		{"ExpiredAbandonedIsFinished", testExpiredAbandonedIsFinished},
		{"ExpiresIn", testExpiresIn},
		{"AbandonedOrder", testAbandonedOrder},
		{"Redrives", testRedrives},
		{"RedriveClaim", testRedriveClaim},
		{"DeleteExpiredBatches", testDeleteExpiredBatches},
	}
	tests = append(tests, inspectCases...) // inspect.go: idemdriver.Inspector
	tests = append(tests, purgeCases...)   // purge.go: idemdriver.Purger
	tests = append(tests, doCases...)      // cases_do.go: idem.Do's records
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.fn(t, h)
		})
	}
}
