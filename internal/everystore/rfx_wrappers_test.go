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

// Stores that are a Sweeper, an Inspector, both or neither (a memstore
// seen through an interface that hides the rest).
type rfxPlain struct{ idem.Store }
type rfxSweeping struct {
	idem.Store
	idemdriver.Sweeper
}
type rfxInspecting struct {
	idem.Store
	idemdriver.Inspector
}

// rfxUnwrapping hides its store's Inspector but unwraps to it.
type rfxUnwrapping struct{ idem.Store }

func (w rfxUnwrapping) Unwrap() idem.Store { return w.Store }

// TestRfxWrappersKeepExactlyTheInterfaces: each wrapper is a Sweeper and
// an Inspector exactly when the store it wraps is one, and the calls reach
// the inner store.
func TestRfxWrappersKeepExactlyTheInterfaces(t *testing.T) {
	ctx := context.Background()
	ms := memstore.New(memstore.Options{})
	stores := []struct {
		name           string
		s              idem.Store
		sweep, inspect bool
	}{
		{"plain", rfxPlain{ms}, false, false},
		{"sweeper", rfxSweeping{ms, ms}, true, false},
		{"inspector", rfxInspecting{ms, ms}, false, true},
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

// TestRfxRedisfrontFollowsUnwrap: redisfront finds the Inspector under a
// wrapper that is not one itself but unwraps to it, and answers
// ErrNoInspector when there is none.
func TestRfxRedisfrontFollowsUnwrap(t *testing.T) {
	ctx := context.Background()
	ms := memstore.New(memstore.Options{})
	rf := redisfront.New(nil, rfxUnwrapping{ms}, redisfront.Options{Timeout: 10 * time.Millisecond})
	if _, err := rf.InspectKey(ctx, "u", "k", 0); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("InspectKey through Unwrap = %v; want ErrNotFound", err)
	}
	rf = redisfront.New(nil, rfxPlain{ms}, redisfront.Options{Timeout: 10 * time.Millisecond})
	if _, err := rf.ListKeys(ctx, idemdriver.ListParams{State: idemdriver.KeyGivenUp, Limit: 1}); !errors.Is(err, redisfront.ErrNoInspector) {
		t.Errorf("ListKeys without an Inspector = %v; want ErrNoInspector", err)
	}
}
