package redisfront

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/redis/go-redis/v9"
)

// Begin implements idem.Store. The Tx it returns wraps the inner store's;
// see Tx.
func (s *Store) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	tx, err := s.inner.Begin(ctx, l)
	if err != nil {
		return nil, err
	}
	return &Tx{s: s, inner: tx, lease: l}, nil
}

// Release implements idem.Store: the inner store releases, then the lease
// lock is dropped.
func (s *Store) Release(ctx context.Context, l *idemdriver.Lease) error {
	err := s.inner.Release(ctx, l)
	s.end(ctx, l, nil)
	return err
}

// Fail implements idem.Store: the inner store ends the lease, then the
// lease lock is dropped, so that the same request may run again at once.
func (s *Store) Fail(ctx context.Context, l *idemdriver.Lease) error {
	err := s.inner.Fail(ctx, l)
	s.end(ctx, l, nil)
	return err
}

// Get implements idem.Store; it asks the inner store.
func (s *Store) Get(ctx context.Context, user, key string) (*idemdriver.Record, error) {
	return s.inner.Get(ctx, user, key)
}

// Abandoned implements idemdriver.Sweeper by delegating to the inner store. It
// returns ErrNoSweeper if the inner store is not an idemdriver.Sweeper.
func (s *Store) Abandoned(ctx context.Context, p idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	sw, ok := s.inner.(idemdriver.Sweeper)
	if !ok {
		return nil, ErrNoSweeper
	}
	return sw.Abandoned(ctx, p)
}

// DeleteExpired implements idemdriver.Sweeper by delegating to the inner store.
// Cached responses need no cleaning: Redis drops them before their records
// expire. It returns ErrNoSweeper if the inner store is not an
// idemdriver.Sweeper.
func (s *Store) DeleteExpired(ctx context.Context, limit int) (int, error) {
	sw, ok := s.inner.(idemdriver.Sweeper)
	if !ok {
		return 0, ErrNoSweeper
	}
	return sw.DeleteExpired(ctx, limit)
}

// minSweep is the size of the lease map below which it is not swept.
const minSweep = 1024

// leaseGrace is how long after its lease ran out an attempt is still
// remembered: it may yet complete if nobody took the key over.
const leaseGrace = time.Minute

// remember keeps what Claim learnt of owner's lease, for its end, and
// returns owner's tag.
func (s *Store) remember(owner string, p idemdriver.ClaimParams, start time.Time, l life) string {
	tag := ownerTag(owner)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.leases[owner] = leaseInfo{fingerprint: p.Fingerprint, tag: tag, life: l, forgetAt: start.Add(p.Lease + leaseGrace)}
	if len(s.leases) < s.nextSweep {
		return tag
	}
	// Attempts that never ended here (their process went on elsewhere, or
	// a caller dropped the lease) must not pile up.
	now := time.Now()
	for o, li := range s.leases {
		if now.After(li.forgetAt) {
			delete(s.leases, o)
		}
	}
	s.nextSweep = max(minSweep, 2*len(s.leases))
	return tag
}

// take returns what Claim learnt of owner's lease, and forgets it.
func (s *Store) take(owner string) (leaseInfo, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	li, ok := s.leases[owner]
	delete(s.leases, owner)
	return li, ok
}

// honoursDeadlines reports whether rdb ends a call when its context's
// deadline passes.
func honoursDeadlines(rdb redis.UniversalClient) bool {
	switch c := rdb.(type) {
	case *redis.Client:
		return c.Options().ContextTimeoutEnabled
	case *redis.ClusterClient:
		return c.Options().ContextTimeoutEnabled
	case *redis.Ring:
		return c.Options().ContextTimeoutEnabled
	}
	return false
}

// run runs script, bounded by Options.Timeout even when the client does
// not honour the context's deadline: the call is then left to finish on
// its own.
func (s *Store) run(ctx context.Context, script *redis.Script, keys []string, args ...any) (any, error) {
	ctx, cancel := context.WithTimeout(ctx, s.opts.Timeout)
	defer cancel()
	if s.direct {
		v, err := script.Run(ctx, s.rdb, keys, args...).Result()
		return v, err
	}
	type result struct {
		v   any
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := script.Run(ctx, s.rdb, keys, args...).Result()
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		return r.v, r.err
	case <-ctx.Done():
		return nil, fmt.Errorf("redisfront: redis call: %w", ctx.Err())
	}
}

// redisFailed counts a failed Redis call and logs it, at most once a
// second. A call cut short by the end of the caller's context is not
// Redis's failure.
func (s *Store) redisFailed(ctx context.Context, op string, err error) {
	if ctx.Err() != nil {
		return
	}
	n := s.opts.Metrics.RedisErrors.Add(1)
	now := time.Now().UnixNano()
	last := s.lastLog.Load()
	if now-last < int64(time.Second) || !s.lastLog.CompareAndSwap(last, now) {
		return
	}
	s.opts.Logger.WarnContext(ctx, "redisfront: redis call failed; the inner store decides alone",
		"op", op, "err", err, "redis_errors", n)
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func newToken() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// ms is d in whole milliseconds for PX, at least 1.
func ms(d time.Duration) int64 { return max(1, d.Milliseconds()) }
