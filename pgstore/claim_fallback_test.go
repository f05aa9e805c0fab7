package pgstore_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
)

// TestClaimWhileClaimFunctionDroppedAndCreated has claims of many keys,
// two racing per key, run while idem_claim is dropped and created again
// and again (a migration rolled back and applied again while instances
// run), or replaced (a later migration that changes its body): every key gets exactly one lease, the other claim a 409, whether
// a claim called the function or the insert-or-read statement.
func TestClaimWhileClaimFunctionDroppedAndCreated(t *testing.T) {
	ctx := context.Background()
	pool := migratedPool(t, pgtest.MaxConns(8))
	create, err := os.ReadFile("migrations/0006_claim_function.sql")
	if err != nil {
		t.Fatal(err)
	}
	var (
		stop    atomic.Bool
		ddl     sync.WaitGroup
		ddlErrs []error
	)
	ddl.Add(1)
	replace := strings.Replace(string(create), "CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
	go func() {
		defer ddl.Done()
		for i := 0; !stop.Load(); i++ {
			statements := []string{`DROP FUNCTION idem_claim`, string(create)}
			if i%2 == 1 {
				// A later migration that changes the body only.
				statements = []string{replace}
			}
			for _, q := range statements {
				if _, err := pool.Exec(ctx, q); err != nil {
					ddlErrs = append(ddlErrs, err)
					return
				}
			}
		}
	}()
	var failures []string
	for round := range 40 {
		// A new store each round: one whose claims have not fallen back.
		s := pgstore.New(pool, pgstore.Options{})
		key := fmt.Sprintf("ddl-%d", round)
		leases, errs := raceClaims(ctx, s, key, 2)
		for _, err := range errs {
			failures = append(failures, fmt.Sprintf("%s: %v", key, err))
		}
		if leases > 1 {
			t.Fatalf("key %s: %d leases", key, leases)
		}
	}
	stop.Store(true)
	ddl.Wait()
	if len(ddlErrs) > 0 {
		t.Fatal(ddlErrs)
	}
	if len(failures) > 0 {
		t.Errorf("%d claims failed: %s", len(failures), strings.Join(failures, "; "))
	}
}
