package redisfront_test

import (
	"os"
	"testing"

	"github.com/idem-go/idem/internal/pgtest"
)

// TestMain leaves the example out, saying why, where the other tests of
// this package skip: without TEST_DATABASE_URL and TEST_REDIS_URL and
// outside CI. An example with an Output comment always runs, so it cannot
// skip on its own.
func TestMain(m *testing.M) {
	pgtest.SkipExamplesWithout(os.Stderr, "redisfront", "TEST_DATABASE_URL", "TEST_REDIS_URL")
	os.Exit(m.Run())
}
