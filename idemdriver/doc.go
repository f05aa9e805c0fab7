// Package idemdriver is what a store implements for package idem, and the
// types it works with: the [Store] and [Tx] interfaces, a claim
// ([ClaimParams], [Claim], [Lease], [Record], [Response]), the sweeper
// that the completer and the cleaner use ([Sweeper], [SweepingStore],
// [AbandonedParams], [ExpiredCleaner]), the operator's inspection and
// re-drive ([Inspector], [KeyState], [StateOf], [CheckRedrive]) and purge
// ([Purger], [CheckPurge]), and the names a store logs instead of keys
// ([KeyID], [OperationID]).
//
// A user of the library does not import it: idem.Store and idem.Tx are
// these interfaces, and idem.Middleware, idem.Do, idem.NewCompleter and
// idem.NewCleaner take any store that implements them. A store's author
// starts here, and proves the store with the conformance suite
// github.com/idem-go/idem/storetest, as memstore, sqlitestore, pgstore and
// redisfront do. The errors a store returns that callers compare with
// errors.Is are idem's (idem.ErrFenced, idem.ErrInFlight, ...), and
// [ErrNotFound], which idem exports as idem.ErrNotFound.
package idemdriver
