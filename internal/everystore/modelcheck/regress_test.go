package modelcheck

import (
	"testing"
	"time"

	"pgregory.net/rapid"
)

// Regression cases: sequences kept from shrunk failures of the model
// checker, and scenarios worth running every time, replayed as fixed
// scripts of the model's steps (no draws) on every store, with the
// oracle after each step and the final drain.
//
// The first three came from shrunk failures that were the model's own
// mistakes, since fixed in the model (none was a protocol bug):
//   - concurrent duplicates on a fresh key, the first claim failing (5xx):
//     a later request of the same step takes the operation over at attempt
//     2, which the model first refused;
//   - concurrent duplicates with a fault on Tx.Complete: only the request
//     the fault hit may answer 503, the model first expected it of all;
//   - a held request taken over and then released with a fault on its
//     Tx.Complete: 503 (the fence was not reached, or its answer was
//     lost), not 409; it commits nothing either way.

// mcScript runs script on a fresh store of each kind, once.
func mcScript(t *testing.T, script func(m *mcModel, rt *rapid.T)) {
	t.Parallel()
	for _, kind := range []mcKind{mcMem, mcSQLite, mcPG, mcRedis} {
		t.Run(kind.String(), func(t *testing.T) {
			fx := mcNewFixture(t, kind)
			rapid.MakeFuzz(func(rt *rapid.T) {
				m := &mcModel{e: fx.newEnv(rt)}
				defer m.teardown()
				m.check(rt)
				script(m, rt)
				m.finish(rt)
			})(t, nil)
		})
	}
}

func TestModelConcurrentTakeoverInStep(t *testing.T) {
	mcScript(t, func(m *mcModel, rt *rapid.T) {
		for range 3 {
			m.doConcurrent(rt, "alice", "k0", []int{0, 0, 0, 0}, []mcOutcome{mcFail, mcOK, mcFail, mcFail}, false, mcOK, "", "")
			m.check(rt)
			m.doConcurrent(rt, "bob", "k0", []int{1, 1, 1}, []mcOutcome{mcPanic, mcRefuse, mcOK}, false, mcOK, "", "")
			m.check(rt)
		}
	})
}

func TestModelConcurrentCompleteFault(t *testing.T) {
	mcScript(t, func(m *mcModel, rt *rapid.T) {
		m.doConcurrent(rt, "alice", "k0", []int{0, 0, 0}, []mcOutcome{mcOK, mcOK, mcOK}, false, mcOK, "complete", "after")
		m.check(rt)
		m.doConcurrent(rt, "alice", "k1", []int{0, 0, 0}, []mcOutcome{mcOK, mcOK, mcOK}, false, mcOK, "complete", "before")
		m.check(rt)
		m.doSequential(rt, "retry_same", "alice", "k1", 0, mcBodyAlt0, mcOK, "", "")
		m.check(rt)
	})
}

func TestModelFencedHeldCompleteFault(t *testing.T) {
	for _, when := range []string{"before", "after"} {
		t.Run(when, func(t *testing.T) {
			mcScript(t, func(m *mcModel, rt *rapid.T) {
				m.doHold(rt, "alice", "k0", 0, mcHoldAfterCharge)
				m.check(rt)
				m.doAdvance(rt, mcLease+time.Second)
				m.check(rt)
				m.doSequential(rt, "retry_same", "alice", "k0", 0, mcBodies[0], mcOK, "", "")
				m.check(rt)
				m.begin(rt, "release held alice/k0, fault complete/%s", when)
				m.releaseHeld(rt, 0, mcOK, "complete", when)
				m.check(rt)
			})
		})
	}
}

// A held attempt (charged) is taken over by the completer once its lease
// ran out; released, it is fenced, and the payment has one order.
func TestModelCompleterFencesHeld(t *testing.T) {
	mcScript(t, func(m *mcModel, rt *rapid.T) {
		m.doHold(rt, "bob", "k2", 1, mcHoldAfterCharge)
		m.check(rt)
		m.doCompleter(rt, mcOK, "", "") // the lease is live: nothing to do
		m.check(rt)
		m.doAdvance(rt, mcLease+time.Second)
		m.check(rt)
		m.doCompleter(rt, mcOK, "", "")
		m.check(rt)
		m.begin(rt, "release held bob/k2")
		m.releaseHeld(rt, 0, mcOK, "", "")
		m.check(rt)
		m.doSequential(rt, "retry_other", "bob", "k2", 0, mcBodies[0], mcOK, "", "")
		m.check(rt)
	})
}

// A failed attempt that paid keeps its key past the TTL: the retry takes
// the same operation over (same derived key), gc deletes nothing of it,
// and only then, once completed and expired, does the key begin anew.
func TestModelPendingOutlivesTTL(t *testing.T) {
	mcScript(t, func(m *mcModel, rt *rapid.T) {
		m.doSequential(rt, "request", "alice", "k2", 0, mcBodies[0], mcFail, "", "")
		m.check(rt)
		m.doAdvance(rt, mcTTL+time.Second)
		m.check(rt)
		m.begin(rt, "gc")
		if _, err := m.e.store.DeleteExpired(t.Context(), 100); err != nil {
			rt.Fatalf("DeleteExpired: %v", err)
		}
		m.check(rt)
		m.doSequential(rt, "retry_other", "alice", "k2", 1, mcBodies[1], mcOK, "", "")
		m.check(rt)
		m.doSequential(rt, "retry_same", "alice", "k2", 0, mcBodies[0], mcOK, "", "")
		m.check(rt)
		m.doAdvance(rt, mcTTL+time.Second)
		m.check(rt)
		m.doSequential(rt, "request", "alice", "k2", 1, mcBodies[1], mcOK, "", "")
		m.check(rt)
	})
}
