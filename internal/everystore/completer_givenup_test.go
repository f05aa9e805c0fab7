package everystore_test

import (
	"context"
	"log/slog"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/storetest"
)

// abandonedHookStore is a memstore whose Abandoned runs after once, after
// listing: what other completers and an operator do between a scan's
// listing and its claims.
type abandonedHookStore struct {
	*memstore.Store
	once  sync.Once
	after func()
}

func (s *abandonedHookStore) Abandoned(ctx context.Context, p idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	recs, err := s.Store.Abandoned(ctx, p)
	s.once.Do(s.after)
	return recs, err
}

// TestCompleterCountsGivenUpByStoreRedrives: a completer counts a key as given up
// (CompleterStats.GivenUp, Metrics.GivenUp, the "left for an operator"
// warning) only when the store's count of re-drives reached its budget.
//
// The bug it guards, as found (the test failed then): the completer
// decided it from the count its scan
// listed (rec.Redrives+1 >= MaxAttempts). With a budget of 2, a scan lists
// a key re-driven once; before its claim, another completer re-drives and
// fails it (2: given up) and an operator's Redrive resets it (0). The
// scan's claim then takes it over (the store counts 1) and fails: the
// completer reports it given up and warns "left for an operator", while
// the key is abandoned, 1 of 2, and the completers re-drive it again.
// Without the Redrive the claim is refused (ErrNotDue) and nothing is
// miscounted. Fix: decide from the count the takeover set (for example a
// Lease field with the record's re-drives, or a Get after the failure).
func TestCompleterCountsGivenUpByStoreRedrives(t *testing.T) {
	ctx := context.Background()
	const budget = 2
	clk := storetest.NewClock(time.Date(2031, 1, 1, 0, 0, 0, 0, time.UTC))
	mem := memstore.New(memstore.Options{Now: clk.Now})
	p := idemdriver.ClaimParams{User: "u", Key: "k", Fingerprint: "fp", Owner: idemdriver.NewOwner(), Method: http.MethodPost,
		Path: "/v1/orders", Body: []byte(`{}`), Lease: 10 * time.Second, TTL: time.Hour}
	first := inspectLease(t, mem, p)
	if err := mem.Fail(ctx, first); err != nil {
		t.Fatal(err)
	}
	leaseWithRedrives(t, mem, p, first.CreatedAt, 1, budget)
	clk.Advance(time.Minute) // past the backoff
	hs := &abandonedHookStore{Store: mem}
	hs.after = func() {
		leaseWithRedrives(t, mem, p, first.CreatedAt, 1, budget) // another completer: given up
		if n, err := mem.Redrive(ctx, "u", "k", budget); err != nil || n != budget {
			t.Errorf("Redrive = %d, %v", n, err)
		}
	}
	c := idem.NewCompleter(hs, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusBadGateway)
	}), idem.CompleterOptions{MaxAttempts: budget, Backoff: time.Second, MaxBackoff: time.Second,
		Middleware: idem.Options{Lease: 10 * time.Second, TTL: time.Hour}, Logger: slog.New(slog.DiscardHandler)})
	st, err := c.RunOnce(ctx)
	if err != nil || st.Scanned != 1 || st.Failed != 1 {
		t.Fatalf("RunOnce = %+v, %v; want one key re-driven and failed", st, err)
	}
	info, err := mem.InspectKey(ctx, "u", "k", budget)
	if err != nil {
		t.Fatal(err)
	}
	if (st.GivenUp == 1) != (info.State == idemdriver.KeyGivenUp) {
		t.Errorf("the completer counted %d keys given up; the key is %s with %d of %d re-drives", st.GivenUp, info.State, info.Redrives, budget)
	}
}
