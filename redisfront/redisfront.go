// Package redisfront puts Redis in front of an idem.Store (PostgreSQL, in
// production) as an accelerator: a duplicate that arrives while the first
// request runs is answered ErrInFlight by Redis alone, and a completed
// response is replayed from Redis, without a statement to the database.
// The inner store stays the source of truth: nothing Redis holds, loses or
// says late can change an outcome. Redis down, flushed, failed over or
// slow, every decision falls back to the inner store.
//
// # What Redis holds
//
// Two keys per (user, key), with one hash tag so that both live on one
// Redis Cluster shard and one script can touch both:
//
//   - PREFIX{h}:resp, a completed response with its fingerprint and the
//     expiry of its record. A completed record never changes until it
//     expires, so the entry answers a repeat exactly as the inner store
//     would: a replay, or ErrFingerprintMismatch for another request. Its
//     expiry is checked against the record's when it is read, ClockSkew
//     early, so it never outlives the record.
//   - PREFIX{h}:lock, either "a claim is being decided by the inner store"
//     (a random token) or "the inner store says owner O holds a lease
//     until U for fingerprint F". Only the second answers ErrInFlight. It
//     lives at most LockTTL, and never past U or the record's expiry, so
//     that a lock Redis kept by mistake (a release that did not reach it, a
//     failover that lost the release) misleads for LockTTL at most; after
//     that the next duplicate asks the inner store again and writes what it
//     learnt.
//
// A third, short-lived key PREFIX{h}:end:O marks an attempt that ended, so
// that a lock for it written late (a slow call, a duplicate that read the
// database just before the end) is refused.
//
// # Claim
//
// One script reads the response and the lock and, when both are missing,
// takes the lock with a claim token (GET, GET, SET PX: atomic, one round
// trip). A cached response answers; a lease lock for the same fingerprint
// that has not run out answers ErrInFlight; a claim in progress is waited
// for (polled every 2ms to 20ms, for at most 4×Timeout) rather than
// answered, because the key may well be completed (Redis was flushed) and
// a 409 would be wrong; anything else goes to the inner store. A lease
// lock for another fingerprint is not taken for ErrFingerprintMismatch
// either: the record it saw may have been released since. What the inner store answers is
// what Claim returns, and it is written back: a Lease becomes the lease
// lock (and drops any cached response, which cannot be current); a Response
// is cached (one inner Get reads the record's expiry); an in-flight answer
// becomes a lease lock as well (one inner Get reads the holder and the
// record's expiry), so that one duplicate per LockTTL reaches the database
// during a long storm.
//
// Release, Fail and Tx.Complete go to the inner store first, then mark the
// attempt ended and compare-and-delete its lock (never a plain DEL);
// Complete also caches the stored response.
//
// # Transactions
//
// Begin wraps the inner store's transaction in a Tx that learns of the
// completion; Tx.Unwrap returns the inner one. A handler that reaches its
// transaction through a store's FromContext needs that function to unwrap
// it (see Tx). Nothing else tells this package that a request completed:
// the inner transaction's Complete is the only place it happens, and
// without learning it a completed key would be answered 409 by its lock
// (until LockTTL) instead of replayed.
//
// # Redis calls
//
// Every Redis call is bounded by Options.Timeout, whether or not the client
// honours context deadlines. A go-redis client does only with
// ContextTimeoutEnabled: set it. The calls then run on the caller's
// goroutine and a call given up on lets go of its connection. Without it,
// each call runs on a goroutine of its own, which the caller stops waiting
// for after Timeout (this costs some 40µs a call on a small machine, and a
// call given up on holds its connection until the client's own timeouts
// end it). A call that fails or times out is counted in
// Metrics.RedisErrors and the request goes on against the inner store
// alone. Scripts run with EVALSHA (EVAL after a NOSCRIPT) and name every key
// they touch in KEYS, so a Redis Cluster routes them.
package redisfront

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idem-go/idem"
	"github.com/redis/go-redis/v9"
)

var (
	_ idem.Store   = (*Store)(nil)
	_ idem.Sweeper = (*Store)(nil)
	_ idem.Tx      = (*Tx)(nil)
)

// ErrNoSweeper is returned by Abandoned and DeleteExpired when the inner
// store does not implement idem.Sweeper.
var ErrNoSweeper = errors.New("redisfront: the inner store does not implement idem.Sweeper")

// Options configures a Store. The zero value is usable: every field
// documents its default.
type Options struct {
	// Timeout bounds each Redis call; a call that takes longer is given up
	// on and the request goes on against the inner store. Default 50ms.
	Timeout time.Duration
	// KeyPrefix begins every Redis key the Store writes. Default "idem:".
	KeyPrefix string
	// LockTTL bounds how long Redis alone answers ErrInFlight for a key
	// after the inner store last reported it leased; then the next
	// duplicate asks the inner store again. It bounds how long a lock that
	// Redis kept by mistake can answer 409, and it is the pace at which a
	// storm of duplicates of a long request reaches the database (one claim
	// and one read per LockTTL). Default 1s.
	LockTTL time.Duration
	// ClockSkew is how far apart the clocks of the instances that share
	// the inner store may be. A cached response is not replayed, nor cached,
	// within ClockSkew of its record's expiry: the inner store decides
	// then. Default 1s.
	ClockSkew time.Duration
	// Now is the clock; it must be the inner store's, which decides leases
	// and expiry. Default time.Now.
	Now func() time.Time
	// Metrics, if set, counts what the Store did. Default: a Metrics of its
	// own, returned by Store.Metrics.
	Metrics *Metrics
	// Logger receives Redis failures (at most one a second; all of them are
	// counted in Metrics.RedisErrors). Default slog.Default().
	Logger *slog.Logger
}

// Defaults for Options.
const (
	DefaultTimeout   = 50 * time.Millisecond
	DefaultKeyPrefix = "idem:"
	DefaultLockTTL   = time.Second
	DefaultClockSkew = time.Second
)

func (o Options) withDefaults() Options {
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.KeyPrefix == "" {
		o.KeyPrefix = DefaultKeyPrefix
	}
	if o.LockTTL <= 0 {
		o.LockTTL = DefaultLockTTL
	}
	if o.ClockSkew <= 0 {
		o.ClockSkew = DefaultClockSkew
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Metrics == nil {
		o.Metrics = new(Metrics)
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return o
}

// Metrics counts what a Store did. All fields are safe for concurrent use;
// read them with Load.
type Metrics struct {
	// RedisErrors counts Redis calls that failed or timed out, after each
	// of which the request went on against the inner store alone.
	RedisErrors atomic.Int64
	// ReplaysFromRedis counts claims answered with a cached response.
	ReplaysFromRedis atomic.Int64
	// MismatchesFromRedis counts claims answered ErrFingerprintMismatch by
	// a cached response.
	MismatchesFromRedis atomic.Int64
	// InFlightFromRedis counts claims answered ErrInFlight by a lease lock.
	InFlightFromRedis atomic.Int64
	// InnerClaims counts claims the inner store decided.
	InnerClaims atomic.Int64
	// ClaimWaits counts claims that waited for another claim of the same
	// key to be decided by the inner store.
	ClaimWaits atomic.Int64
	// CacheFills counts responses written to Redis.
	CacheFills atomic.Int64
	// LocksSet counts lease locks written to Redis.
	LocksSet atomic.Int64
}

// Store is an idem.Store that answers from Redis what Redis knows for sure
// and asks the inner store everything else. It implements idem.Sweeper by
// delegating to the inner store. It is safe for concurrent use.
type Store struct {
	rdb   redis.UniversalClient
	inner idem.Store
	opts  Options
	// claimWait bounds the wait for another claim in progress, and the
	// life of a claim token in Redis.
	claimWait time.Duration
	// direct: rdb ends a call when its context's deadline passes, so calls
	// need no goroutine of their own.
	direct bool

	mu        sync.Mutex // guards leases and nextSweep
	leases    map[string]leaseInfo
	nextSweep int

	lastLog atomic.Int64 // when a Redis failure was last logged, unix nanoseconds
}

// leaseInfo is what Claim learnt about a lease it handed out, for
// Tx.Complete to cache the response: the fingerprint and the record's
// expiry (zero when unknown).
type leaseInfo struct {
	fingerprint string
	expiresAt   time.Time
	until       time.Time
}

// New returns a Store that fronts inner with rdb (a *redis.Client, a
// *redis.ClusterClient, or any redis.UniversalClient).
func New(rdb redis.UniversalClient, inner idem.Store, opts Options) *Store {
	opts = opts.withDefaults()
	return &Store{
		rdb:       rdb,
		inner:     inner,
		opts:      opts,
		claimWait: 4 * opts.Timeout,
		direct:    honoursDeadlines(rdb),
		leases:    make(map[string]leaseInfo),
		nextSweep: minSweep,
	}
}

// Metrics returns the counters the Store updates (Options.Metrics, or its
// own).
func (s *Store) Metrics() *Metrics { return s.opts.Metrics }

// Inner returns the store that decides.
func (s *Store) Inner() idem.Store { return s.inner }

// keys are the Redis keys of one (user, key).
type keys struct {
	lock, resp string
	base       string // PREFIX{hash}, for the end markers
}

func (s *Store) keysFor(user, key string) keys {
	h := sha256.New()
	var n [binary.MaxVarintLen64]byte
	h.Write(n[:binary.PutUvarint(n[:], uint64(len(user)))])
	h.Write([]byte(user))
	h.Write([]byte(key))
	base := s.opts.KeyPrefix + "{" + hex.EncodeToString(h.Sum(nil))[:32] + "}"
	return keys{lock: base + ":lock", resp: base + ":resp", base: base}
}

// endKey is the marker of owner's ended attempt.
func (k keys) endKey(owner string) string { return k.base + ":end:" + ownerTag(owner) }

// Claim implements idem.Store.
func (s *Store) Claim(ctx context.Context, p idem.ClaimParams) (idem.Claim, error) {
	if err := ctx.Err(); err != nil {
		return idem.Claim{}, err
	}
	p = p.Normalize()
	k := s.keysFor(p.User, p.Key)
	token := claimValue(newToken())
	held := false
	deadline := time.Now().Add(s.claimWait)
	pause := 2 * time.Millisecond
	waited := false
look:
	for {
		res, err := s.run(ctx, claimScript, []string{k.lock, k.resp}, token, ms(s.claimWait))
		if err != nil {
			s.redisFailed(ctx, "claim", err)
			return s.fallback(ctx, p)
		}
		kind, val, err := claimResult(res)
		if err != nil {
			s.redisFailed(ctx, "claim", err)
			return s.fallback(ctx, p)
		}
		now := s.opts.Now()
		switch kind {
		case claimCached:
			e, err := decodeEntry(val)
			if err != nil || !now.Add(s.opts.ClockSkew).Before(e.expiresAt) {
				break look // unreadable or about to expire: the inner store decides
			}
			if e.fingerprint != p.Fingerprint {
				s.opts.Metrics.MismatchesFromRedis.Add(1)
				return idem.Claim{}, idem.ErrFingerprintMismatch
			}
			s.opts.Metrics.ReplaysFromRedis.Add(1)
			return idem.Claim{Response: e.resp}, nil
		case claimLocked:
			l, ok := parseLock(val)
			switch {
			case ok && l.leased && l.fingerprint == p.Fingerprint && now.Before(l.until):
				s.opts.Metrics.InFlightFromRedis.Add(1)
				return idem.Claim{}, &idem.InFlightError{LeaseUntil: l.until}
			case ok && !l.leased && time.Now().Before(deadline):
				// Another claim is being decided: its answer, a lease
				// lock or a cached response, is what this one needs.
				if !waited {
					waited = true
					s.opts.Metrics.ClaimWaits.Add(1)
				}
				if err := sleep(ctx, min(pause, time.Until(deadline))); err != nil {
					return idem.Claim{}, err
				}
				pause = min(2*pause, 20*time.Millisecond)
				continue
			}
			// Another fingerprint (a lock is not proof of a mismatch: the
			// record may have been released since), a lease run out, or a
			// claim that takes too long: the inner store decides.
			break look
		case claimTaken:
			held = true
			break look
		}
	}
	if !held {
		token = ""
	}
	return s.decide(ctx, p, k, token)
}

// fallback is Claim against the inner store alone, after a Redis failure.
func (s *Store) fallback(ctx context.Context, p idem.ClaimParams) (idem.Claim, error) {
	s.opts.Metrics.InnerClaims.Add(1)
	c, err := s.inner.Claim(ctx, p)
	if err == nil && c.Lease != nil {
		exp := time.Time{}
		if c.Lease.Attempt == 1 {
			exp = c.Lease.CreatedAt.Add(p.TTL)
		}
		s.remember(c.Lease, p.Fingerprint, exp)
	}
	return c, err
}

// decide lets the inner store decide the claim and writes to Redis what
// it learnt. token is the claim token this call holds the lock with, or
// "". Whatever happens in Redis, the inner store's answer is returned.
func (s *Store) decide(ctx context.Context, p idem.ClaimParams, k keys, token string) (idem.Claim, error) {
	s.opts.Metrics.InnerClaims.Add(1)
	c, err := s.inner.Claim(ctx, p)
	switch {
	case err == nil && c.Lease != nil:
		l := c.Lease
		var exp time.Time
		if l.Attempt == 1 {
			// A new record: the inner store set its expiry from p.TTL.
			exp = l.CreatedAt.Add(p.TTL)
		} else if rec, gerr := s.inner.Get(ctx, p.User, p.Key); gerr == nil && rec.Owner == l.Owner {
			// A takeover keeps the record's expiry, which only it knows.
			exp = rec.ExpiresAt
		}
		s.remember(l, p.Fingerprint, exp)
		if !exp.IsZero() && s.setLock(ctx, k, l.Owner, minTime(l.Until, exp), p.Fingerprint) {
			return c, err
		}
	case err == nil && c.Response != nil:
		// The record's expiry bounds the cache entry: read it once.
		if rec, gerr := s.inner.Get(ctx, p.User, p.Key); gerr == nil && rec.Response != nil {
			s.fill(ctx, k, rec, token)
			return c, err
		}
	case errors.Is(err, idem.ErrInFlight):
		// Keep what the inner store said, so that the next duplicates are
		// answered by Redis. Its holder and the record's expiry make the
		// lock exact: read them.
		rec, gerr := s.inner.Get(ctx, p.User, p.Key)
		now := s.opts.Now()
		switch {
		case gerr != nil:
		case rec.Response != nil:
			s.fill(ctx, k, rec, token)
			return c, err
		case rec.Fingerprint == p.Fingerprint && now.Before(rec.LeaseUntil):
			if s.setLock(ctx, k, rec.Owner, minTime(rec.LeaseUntil, rec.ExpiresAt), p.Fingerprint) {
				return c, err
			}
		}
	}
	if token != "" {
		s.unlock(ctx, k, token)
	}
	return c, err
}

// setLock records in Redis that owner holds (user, key) with fingerprint
// until until, unless that attempt already ended. It reports whether the
// lock was written.
func (s *Store) setLock(ctx context.Context, k keys, owner string, until time.Time, fingerprint string) bool {
	px := min(s.opts.LockTTL, until.Sub(s.opts.Now()))
	if px < time.Millisecond {
		return false
	}
	res, err := s.run(ctx, setLockScript, []string{k.lock, k.endKey(owner), k.resp}, leaseValue(owner, until, fingerprint), ms(px))
	if err != nil {
		s.redisFailed(ctx, "lock", err)
		return false
	}
	if n, _ := res.(int64); n == 1 {
		s.opts.Metrics.LocksSet.Add(1)
		return true
	}
	return false
}

// fill caches rec's response, and drops the claim token this call holds
// the lock with, if any.
func (s *Store) fill(ctx context.Context, k keys, rec *idem.Record, token string) {
	val, px := s.entryFor(rec.Fingerprint, rec.ExpiresAt, rec.Response)
	if val == "" && token == "" {
		return
	}
	if _, err := s.run(ctx, fillScript, []string{k.resp, k.lock}, val, ms(px), token); err != nil {
		s.redisFailed(ctx, "fill", err)
		return
	}
	if val != "" {
		s.opts.Metrics.CacheFills.Add(1)
	}
}

// unlock drops the claim token this call holds the lock with, if it still
// does: a compare-and-delete.
func (s *Store) unlock(ctx context.Context, k keys, token string) {
	if _, err := s.run(ctx, unlockScript, []string{k.lock}, token); err != nil {
		s.redisFailed(ctx, "unlock", err)
	}
}

// entryFor encodes a cache entry and the time Redis keeps it: until
// ClockSkew before the record expires. It returns "" when the record
// expires too soon to be worth caching.
func (s *Store) entryFor(fingerprint string, expiresAt time.Time, resp *idem.Response) (string, time.Duration) {
	px := expiresAt.Sub(s.opts.Now()) - s.opts.ClockSkew
	if px < time.Millisecond || resp == nil {
		return "", 0
	}
	return encodeEntry(fingerprint, expiresAt, resp), px
}

// end marks l's attempt ended, caches e (when not ""), and drops l's
// lease lock if it is still there. The inner store has already settled l.
func (s *Store) end(ctx context.Context, l *idem.Lease, entry string, px time.Duration) {
	s.forget(l.Owner)
	k := s.keysFor(l.User, l.Key)
	_, err := s.run(ctx, endScript, []string{k.lock, k.endKey(l.Owner), k.resp},
		leasePrefix(l.Owner), ms(s.opts.LockTTL), entry, ms(px))
	if err != nil {
		s.redisFailed(ctx, "end", err)
		return
	}
	if entry != "" {
		s.opts.Metrics.CacheFills.Add(1)
	}
}

// Begin implements idem.Store. The Tx it returns wraps the inner store's;
// see Tx.
func (s *Store) Begin(ctx context.Context, l *idem.Lease) (idem.Tx, error) {
	tx, err := s.inner.Begin(ctx, l)
	if err != nil {
		return nil, err
	}
	return &Tx{s: s, inner: tx, lease: l}, nil
}

// Release implements idem.Store: the inner store releases, then the lease
// lock is dropped.
func (s *Store) Release(ctx context.Context, l *idem.Lease) error {
	err := s.inner.Release(ctx, l)
	s.end(ctx, l, "", 0)
	return err
}

// Fail implements idem.Store: the inner store ends the lease, then the
// lease lock is dropped, so that the same request may run again at once.
func (s *Store) Fail(ctx context.Context, l *idem.Lease) error {
	err := s.inner.Fail(ctx, l)
	s.end(ctx, l, "", 0)
	return err
}

// Get implements idem.Store; it asks the inner store.
func (s *Store) Get(ctx context.Context, user, key string) (*idem.Record, error) {
	return s.inner.Get(ctx, user, key)
}

// Abandoned implements idem.Sweeper by delegating to the inner store. It
// returns ErrNoSweeper if the inner store is not an idem.Sweeper.
func (s *Store) Abandoned(ctx context.Context, limit int) ([]idem.Record, error) {
	sw, ok := s.inner.(idem.Sweeper)
	if !ok {
		return nil, ErrNoSweeper
	}
	return sw.Abandoned(ctx, limit)
}

// DeleteExpired implements idem.Sweeper by delegating to the inner store.
// Cached responses need no cleaning: Redis drops them when their records
// expire. It returns ErrNoSweeper if the inner store is not an
// idem.Sweeper.
func (s *Store) DeleteExpired(ctx context.Context, limit int) (int, error) {
	sw, ok := s.inner.(idem.Sweeper)
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

func (s *Store) remember(l *idem.Lease, fingerprint string, expiresAt time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.leases[l.Owner] = leaseInfo{fingerprint: fingerprint, expiresAt: expiresAt, until: l.Until}
	if len(s.leases) < s.nextSweep {
		return
	}
	// Attempts that never ended here (their process went on elsewhere, or
	// a caller dropped the lease) must not pile up.
	cutoff := s.opts.Now().Add(-leaseGrace)
	for o, li := range s.leases {
		if li.until.Before(cutoff) {
			delete(s.leases, o)
		}
	}
	s.nextSweep = max(minSweep, 2*len(s.leases))
}

func (s *Store) lookup(owner string) (leaseInfo, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	li, ok := s.leases[owner]
	return li, ok
}

func (s *Store) forget(owner string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.leases, owner)
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

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}
