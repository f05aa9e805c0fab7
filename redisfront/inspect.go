package redisfront

import (
	"context"
	"errors"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

var (
	_ idemdriver.Inspector = (*Store)(nil)
	_ idemdriver.Purger    = (*Store)(nil)
)

// ErrNoInspector is returned by InspectKey, ListKeys and Redrive when
// neither the inner store nor a store it wraps (followed through
// Unwrap() idem.Store) implements idemdriver.Inspector.
var ErrNoInspector = errors.New("redisfront: the inner store does not implement idemdriver.Inspector")

// InspectKey implements idemdriver.Inspector by asking the inner store, which
// holds every record; Redis holds copies of completed responses only.
func (s *Store) InspectKey(ctx context.Context, user, key string, maxRedrives int) (*idemdriver.KeyInfo, error) {
	in, ok := s.inspector()
	if !ok {
		return nil, ErrNoInspector
	}
	return in.InspectKey(ctx, user, key, maxRedrives)
}

// ListKeys implements idemdriver.Inspector by asking the inner store.
func (s *Store) ListKeys(ctx context.Context, p idemdriver.ListParams) ([]idemdriver.KeyInfo, error) {
	in, ok := s.inspector()
	if !ok {
		return nil, ErrNoInspector
	}
	return in.ListKeys(ctx, p)
}

// Redrive implements idemdriver.Inspector by passing through to the inner store.
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

// ErrNoPurger is returned by Purge when neither the inner store nor a
// store it wraps (followed through Unwrap() idem.Store) implements
// idemdriver.Purger.
var ErrNoPurger = errors.New("redisfront: the inner store does not implement idemdriver.Purger")

// Purge implements idemdriver.Purger. The inner store holds the record and
// decides; Redis may hold a lease lock of the attempt seen, which would
// answer a retry ErrInFlight for a key that no longer exists. So the lock
// goes first: the attempt seen is marked ended in Redis and its lease lock
// deleted (a lock for it written late is refused by the mark), then the
// inner store purges, then Redis is cleaned again (in case the first call
// failed, or the mark ran out while the inner store waited). A retry thus never finds the purged attempt's lock once the
// record is gone (unless Redis failed twice: then for LockTTL at most). A
// refusal of the inner store leaves Redis without a cached copy of the
// key, which only sends the next claim to the inner store.
func (s *Store) Purge(ctx context.Context, user, key string, seen idemdriver.Seen) (*idemdriver.Record, error) {
	pu, ok := findStore[idemdriver.Purger](s.inner)
	if !ok {
		return nil, ErrNoPurger
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	k := s.keysFor(user, key)
	tag := ownerTag(seen.Owner)
	clean := func() {
		if _, err := s.run(ctx, purgeScript, []string{k.lock, k.endKeyTag(tag), k.resp}, leaseTagPrefix(tag), s.lockTTLMS); err != nil {
			s.redisFailed(ctx, "purge", err)
		}
	}
	clean()
	rec, err := pu.Purge(ctx, user, key, seen)
	if err == nil {
		clean()
	}
	return rec, err
}

// findStore returns st as a T, or else the first store under it,
// followed through Unwrap() idem.Store (a wrapper for metrics or traces),
// that is one.
func findStore[T any](st idem.Store) (T, bool) {
	for i := 0; st != nil && i < 16; i++ {
		if in, ok := st.(T); ok {
			return in, true
		}
		u, ok := st.(interface{ Unwrap() idem.Store })
		if !ok {
			break
		}
		st = u.Unwrap()
	}
	var zero T
	return zero, false
}

// inspector returns the inner store as an idemdriver.Inspector, or else the
// first store under it, followed through Unwrap() idem.Store (a wrapper
// for metrics or traces), that is one.
func (s *Store) inspector() (idemdriver.Inspector, bool) {
	return findStore[idemdriver.Inspector](s.inner)
}
