package redisfront

import (
	"context"
	"errors"

	"github.com/idem-go/idem"
)

var _ idem.Inspector = (*Store)(nil)

// ErrNoInspector is returned by InspectKey, ListKeys and Redrive when
// neither the inner store nor a store it wraps (followed through
// Unwrap() idem.Store) implements idem.Inspector.
var ErrNoInspector = errors.New("redisfront: the inner store does not implement idem.Inspector")

// InspectKey implements idem.Inspector by asking the inner store, which
// holds every record; Redis holds copies of completed responses only.
func (s *Store) InspectKey(ctx context.Context, user, key string, maxRedrives int) (*idem.KeyInfo, error) {
	in, ok := s.inspector()
	if !ok {
		return nil, ErrNoInspector
	}
	return in.InspectKey(ctx, user, key, maxRedrives)
}

// ListKeys implements idem.Inspector by asking the inner store.
func (s *Store) ListKeys(ctx context.Context, p idem.ListParams) ([]idem.KeyInfo, error) {
	in, ok := s.inspector()
	if !ok {
		return nil, ErrNoInspector
	}
	return in.ListKeys(ctx, p)
}

// Redrive implements idem.Inspector by passing through to the inner store.
// Redis needs no change: it caches responses only, and a key re-driven has
// none; a lease lock it may hold mirrors the record's lease, which Redrive
// leaves as it is.
func (s *Store) Redrive(ctx context.Context, user, key string, maxRedrives int) (int, error) {
	in, ok := s.inspector()
	if !ok {
		return 0, ErrNoInspector
	}
	return in.Redrive(ctx, user, key, maxRedrives)
}

// inspector returns the inner store as an idem.Inspector, or else the
// first store under it, followed through Unwrap() idem.Store (a wrapper
// for metrics or traces), that is one.
func (s *Store) inspector() (idem.Inspector, bool) {
	st := s.inner
	for i := 0; st != nil && i < 16; i++ {
		if in, ok := st.(idem.Inspector); ok {
			return in, true
		}
		u, ok := st.(interface{ Unwrap() idem.Store })
		if !ok {
			return nil, false
		}
		st = u.Unwrap()
	}
	return nil, false
}
