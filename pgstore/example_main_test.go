package pgstore_test

import (
	"os"
	"testing"

	"github.com/idem-go/idem/internal/pgtest"
)

// TestMain leaves the examples out, saying why, where the other tests of
// this package skip: without TEST_DATABASE_URL and outside CI. An example
// with an Output comment always runs, so it cannot skip on its own.
func TestMain(m *testing.M) {
	pgtest.SkipExamplesWithout(os.Stderr, "pgstore", "TEST_DATABASE_URL")
	os.Exit(m.Run())
}
