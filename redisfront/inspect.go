package redisfront

import (
	"context"
	"errors"

	"github.com/idem-go/idem"
)

var _ idem.Inspector = (*Store)(nil)

// ErrNoInspector is returned by InspectKey, ListKeys and Redrive when the
// inner store does not implement idem.Inspector.
var ErrNoInspector = errors.New("redisfront: the inner store does not implement idem.Inspector")

// InspectKey implements idem.Inspector by asking the inner store, which
// holds every record; Redis holds copies of completed responses only.
func (s *Store) InspectKey(ctx context.Context, user, key string, maxRedrives int) (*idem.KeyInfo, error) {
	in, ok := s.inner.(idem.Inspector)
	if !ok {
		return nil, ErrNoInspector
	}
	return in.InspectKey(ctx, user, key, maxRedrives)
}

// ListKeys implements idem.Inspector by asking the inner store.
func (s *Store) ListKeys(ctx context.Context, p idem.ListParams) ([]idem.KeyInfo, error) {
	in, ok := s.inner.(idem.Inspector)
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
	in, ok := s.inner.(idem.Inspector)
	if !ok {
		return 0, ErrNoInspector
	}
	return in.Redrive(ctx, user, key, maxRedrives)
}
