package memstore

import (
	"context"
	"slices"
	"strings"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

var _ idemdriver.Inspector = (*Store)(nil)

// InspectKey implements idemdriver.Inspector.
func (s *Store) InspectKey(ctx context.Context, user, key string, maxRedrives int) (*idemdriver.KeyInfo, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	rec, ok := s.copyOf(id{user, key})
	if !ok {
		return nil, idem.ErrNotFound
	}
	st := idemdriver.StateOf(rec, now, maxRedrives)
	if st == "" {
		return nil, idem.ErrNotFound
	}
	return &idemdriver.KeyInfo{Record: *rec, State: st, At: now}, nil
}

// copyOf returns a copy of k's record, in flight or completed. Callers
// hold s.mu.
func (s *Store) copyOf(k id) (*idemdriver.Record, bool) {
	if e, ok := s.recs[k]; ok {
		return cloneRecord(&e.rec), true
	}
	if sl, _, ok := s.findDone(k); ok {
		return s.record(s.arena.get(sl)), true
	}
	return nil, false
}

// ListKeys implements idemdriver.Inspector.
func (s *Store) ListKeys(ctx context.Context, p idemdriver.ListParams) ([]idemdriver.KeyInfo, error) {
	if _, err := idemdriver.ParseKeyState(string(p.State)); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if p.Limit <= 0 {
		return nil, nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	var out []idemdriver.KeyInfo
	for _, e := range s.recs {
		if idemdriver.StateOf(&e.rec, now, p.MaxRedrives) == p.State {
			out = append(out, idemdriver.KeyInfo{Record: *cloneRecord(&e.rec), State: p.State, At: now})
		}
	}
	if p.State == idemdriver.KeyCompleted { // the state of every completed record that has not expired
		add := func(sl slot) {
			if b := s.arena.get(sl); now.Before(s.expiresAt(b)) {
				out = append(out, idemdriver.KeyInfo{Record: *s.record(b), State: p.State, At: now})
			}
		}
		for _, sl := range s.done {
			add(sl)
		}
		for _, sl := range s.clash {
			add(sl)
		}
	}
	slices.SortFunc(out, func(a, b idemdriver.KeyInfo) int {
		if p.State == idemdriver.KeyCompleted {
			if c := b.CompletedAt.Compare(a.CompletedAt); c != 0 {
				return c
			}
		} else {
			if c := a.LeaseUntil.Compare(b.LeaseUntil); c != 0 {
				return c
			}
			if c := a.CreatedAt.Compare(b.CreatedAt); c != 0 {
				return c
			}
		}
		if c := strings.Compare(a.User, b.User); c != 0 {
			return c
		}
		return strings.Compare(a.Key, b.Key)
	})
	if len(out) > p.Limit {
		out = out[:p.Limit]
	}
	return out, nil
}

// Redrive implements idemdriver.Inspector: under the store's lock, the check
// and the reset are one step.
func (s *Store) Redrive(ctx context.Context, user, key string, maxRedrives int) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	k := id{user, key}
	e, ok := s.recs[k]
	if !ok {
		if rec, ok := s.copyOf(k); ok {
			// Completed: never given up.
			return 0, idemdriver.CheckRedrive(idemdriver.StateOf(rec, s.now(), maxRedrives))
		}
		return 0, idem.ErrNotFound
	}
	if err := idemdriver.CheckRedrive(idemdriver.StateOf(&e.rec, s.now(), maxRedrives)); err != nil {
		return 0, err
	}
	n := e.rec.Redrives
	e.rec.Redrives = 0
	return n, nil
}

var _ idemdriver.Purger = (*Store)(nil)

// Purge implements idemdriver.Purger: under the store's lock, the check and the
// delete are one step.
func (s *Store) Purge(ctx context.Context, user, key string, seen idemdriver.Seen) (*idemdriver.Record, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	k := id{user, key}
	e, ok := s.recs[k]
	if !ok {
		if rec, ok := s.copyOf(k); ok {
			// Completed: never purged, expired or not.
			return nil, idemdriver.CheckPurge(rec, s.now(), seen)
		}
		return nil, idem.ErrNotFound
	}
	if err := idemdriver.CheckPurge(&e.rec, s.now(), seen); err != nil {
		return nil, err
	}
	delete(s.recs, k)
	return cloneRecord(&e.rec), nil
}
