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

// TestWrappersKeepInspector: a store wrapped for metrics
// (idemprom.StoreMetrics.Wrap) or traces (idemotel.WrapStore) is still an
// idemdriver.Inspector when the store is, as it is still an idemdriver.Sweeper; and
// redisfront in front of a wrapped store still inspects and re-drives
// (redisfront forwards Inspector to its inner store).
//
// The bug it guards, as found (the test failed then): both wrappers
// forwarded Sweeper but not Inspector, so
// the operator's calls are lost as soon as the store is instrumented:
// s.(idemdriver.Inspector) is false, and redisfront.New(rdb, wrapped) answers
// every InspectKey, ListKeys and Redrive with redisfront.ErrNoInspector.
// Nothing in idem follows Unwrap() idem.Store to find it either.
func TestWrappersKeepInspector(t *testing.T) {
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

// Stores that are a Sweeper, an Inspector, both or neither (a memstore
// seen through an interface that hides the rest).
type plainStore struct{ idem.Store }
type sweepingStore struct {
	idem.Store
	idemdriver.Sweeper
}
type inspectingStore struct {
	idem.Store
	idemdriver.Inspector
}

// unwrappingStore hides its store's Inspector but unwraps to it.
type unwrappingStore struct{ idem.Store }

func (w unwrappingStore) Unwrap() idem.Store { return w.Store }

// TestWrappersKeepExactlyTheInterfaces: each wrapper is a Sweeper and
// an Inspector exactly when the store it wraps is one, and the calls reach
// the inner store.
func TestWrappersKeepExactlyTheInterfaces(t *testing.T) {
	ctx := context.Background()
	ms := memstore.New(memstore.Options{})
	stores := []struct {
		name           string
		s              idem.Store
		sweep, inspect bool
	}{
		{"plain", plainStore{ms}, false, false},
		{"sweeper", sweepingStore{ms, ms}, true, false},
		{"inspector", inspectingStore{ms, ms}, false, true},
		{"both", ms, true, true},
	}
	wrappers := []struct {
		name string
		wrap func(idem.Store) idem.Store
	}{
		{"idemprom", func(s idem.Store) idem.Store { return idemprom.NewStoreMetrics().Wrap(s) }},
		{"idemotel", func(s idem.Store) idem.Store { return idemotel.WrapStore(s, idemotel.Options{}) }},
	}
	for _, w := range wrappers {
		for _, st := range stores {
			got := w.wrap(st.s)
			_, sweep := got.(idemdriver.Sweeper)
			in, inspect := got.(idemdriver.Inspector)
			if sweep != st.sweep || inspect != st.inspect {
				t.Errorf("%s over %s: Sweeper %v, Inspector %v; want %v, %v", w.name, st.name, sweep, inspect, st.sweep, st.inspect)
			}
			if inspect {
				if _, err := in.Redrive(ctx, "u", "none", 0); !errors.Is(err, idem.ErrNotFound) {
					t.Errorf("%s over %s: Redrive = %v; want ErrNotFound", w.name, st.name, err)
				}
			}
			if u, ok := got.(interface{ Unwrap() idem.Store }); !ok || u.Unwrap() != st.s {
				t.Errorf("%s over %s: does not unwrap to its store", w.name, st.name)
			}
		}
	}
}

// TestRedisfrontFollowsUnwrap: redisfront finds the Inspector under a
// wrapper that is not one itself but unwraps to it, and answers
// ErrNoInspector when there is none.
func TestRedisfrontFollowsUnwrap(t *testing.T) {
	ctx := context.Background()
	ms := memstore.New(memstore.Options{})
	rf := redisfront.New(nil, unwrappingStore{ms}, redisfront.Options{Timeout: 10 * time.Millisecond})
	if _, err := rf.InspectKey(ctx, "u", "k", 0); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("InspectKey through Unwrap = %v; want ErrNotFound", err)
	}
	rf = redisfront.New(nil, plainStore{ms}, redisfront.Options{Timeout: 10 * time.Millisecond})
	if _, err := rf.ListKeys(ctx, idemdriver.ListParams{State: idemdriver.KeyGivenUp, Limit: 1}); !errors.Is(err, redisfront.ErrNoInspector) {
		t.Errorf("ListKeys without an Inspector = %v; want ErrNoInspector", err)
	}
}
