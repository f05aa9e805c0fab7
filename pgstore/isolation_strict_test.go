package pgstore_test

import "testing"

// TestConformanceStrictIsolation runs the conformance suite on the bare
// store with the database's default isolation at REPEATABLE READ and
// SERIALIZABLE, with no wrapper resending claims. Before Claim read a
// serialization failure (40001) of its conditional statements as "the row
// changed, decide again", two claims racing to take one key over
// (ConcurrentTakeover, ConcurrentRetriesExecuteOnce) got the raw 40001
// from takeOver's UPDATE, and the store failed its own suite (issue 10,
// point 4).
func TestConformanceStrictIsolation(t *testing.T) {
	for _, level := range skewIsolationLevels {
		t.Run(level, func(t *testing.T) { skewConformance(t, level, nil) })
	}
}
