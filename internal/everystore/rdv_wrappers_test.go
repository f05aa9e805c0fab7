package everystore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/idemotel"
	"github.com/idem-go/idem/idemprom"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/redisfront"
)

// TestRdvWrappersKeepInspector: a store wrapped for metrics
// (idemprom.StoreMetrics.Wrap) or traces (idemotel.WrapStore) is still an
// idemdriver.Inspector when the store is, as it is still an idemdriver.Sweeper; and
// redisfront in front of a wrapped store still inspects and re-drives
// (redisfront forwards Inspector to its inner store).
//
// FINDING (fails): both wrappers forward Sweeper but not Inspector, so
// the operator's calls are lost as soon as the store is instrumented:
// s.(idemdriver.Inspector) is false, and redisfront.New(rdb, wrapped) answers
// every InspectKey, ListKeys and Redrive with redisfront.ErrNoInspector.
// Nothing in idem follows Unwrap() idem.Store to find it either.
func TestRdvWrappersKeepInspector(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		wrap func(idem.Store) idem.Store
	}{
		{"idemprom", func(s idem.Store) idem.Store { return idemprom.NewStoreMetrics().Wrap(s) }},
		{"idemotel", func(s idem.Store) idem.Store { return idemotel.WrapStore(s, idemotel.Options{}) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inner := memstore.New(memstore.Options{})
			w := tc.wrap(inner)
			if _, ok := w.(idemdriver.Sweeper); !ok {
				t.Fatalf("%T is not a Sweeper", w)
			}
			if _, ok := w.(idemdriver.Inspector); !ok {
				t.Errorf("%T wraps an idemdriver.Inspector but is not one", w)
			}
			// redisfront in front of the wrapped store, Redis unreachable
			// (the Inspector's calls never go to Redis).
			rf := redisfront.New(nil, w, redisfront.Options{Timeout: 10 * time.Millisecond})
			if _, err := rf.InspectKey(ctx, "u", "k", 0); !errors.Is(err, idem.ErrNotFound) {
				t.Errorf("redisfront over %s: InspectKey = %v; want ErrNotFound", tc.name, err)
			}
		})
	}
}
