// Package redisfront puts Redis in front of an idem.Store (PostgreSQL, in
// production) as an accelerator: a duplicate that arrives while the first
// request runs is answered ErrInFlight by Redis alone, and a completed
// response is replayed from Redis, without a statement to the database.
// The inner store stays the source of truth: nothing Redis holds, loses or
// says late can change an outcome. Redis down, flushed, failed over or
// slow, every decision falls back to the inner store.
//
// [New] puts a go-redis client in front of the inner store. A handler
// keeps reaching its transaction through the inner store's accessor
// (pgstore.FromContext), which unwraps this package's [Tx]. Example runs it
// in front of pgstore, against PostgreSQL and Redis servers in go test.
//
// # What Redis holds
//
// Two keys per (user, key), with one hash tag so that both live on one
// Redis Cluster shard and one script can touch both:
//
//   - PREFIX{h}:resp, a completed response with its fingerprint. A
//     completed record never changes until it expires, so the entry
//     answers a repeat exactly as the inner store would: a replay, or
//     ErrFingerprintMismatch for another request. It never outlives the
//     record: its lifetime (PX) is the record's remaining life as the
//     inner store reported it in Claim.ExpiresIn (by the store's own
//     clock; the database's, for pgstore), counted on this process's
//     monotonic clock from just before that claim was sent, less
//     CacheMargin and 0.1% of that life (for clocks that tick at slightly
//     different rates). No instance's wall clock enters it. When the life
//     is unknown, zero, or has run out (a takeover of a record whose
//     expiry passed, which the store extends when it completes), nothing
//     is cached.
//   - PREFIX{h}:lock, either "a claim is being decided by the inner store"
//     (a claim token: the Store's random prefix and a sequence number) or
//     "the inner store says owner O holds a lease for fingerprint F".
//     Only the second answers ErrInFlight, and never to O itself (a claim
//     sent again with the same ClaimParams.Owner, whose first answer was
//     lost, gets its lease from the inner store). It
//     lives at most LockTTL, and no longer than the lease as this process
//     measured it; so a lock Redis kept by mistake (a release that did not
//     reach it, a failover that lost the release) misleads for LockTTL at
//     most, and after that the next duplicate asks the inner store again
//     and writes what it learnt. A record without a response never
//     expires, so only the lease bounds the lock.
//
// A third, short-lived key PREFIX{h}:end:O marks an attempt that ended, so
// that a lock for it written late (a slow call, a duplicate that read the
// database just before the end) is refused.
//
// Redis times its keys by its own clock: a Redis whose clock jumps forward
// drops entries early (harmless); one stepped back by more than
// CacheMargin, or a failover to a replica whose clock is behind, would
// keep them longer.
//
// # Claim
//
// One script reads the response and the lock and, when both are missing,
// takes the lock with a claim token (GET, GET, SET PX: atomic, one round
// trip). A cached response answers; a lease lock of another owner for the
// same fingerprint answers ErrInFlight; a claim in progress is waited for
// (polled every 2ms to 20ms, for at most 4×Timeout) rather than answered,
// because the key may well be completed (Redis was flushed) and a 409
// would be wrong; anything else goes to the inner store, with the
// ClaimParams as given (p.Owner included). A lease lock for another
// fingerprint is not taken for ErrFingerprintMismatch either: the record
// it saw may have been released since. What the inner store answers is
// what Claim returns, and it is written back: a Lease becomes the lease
// lock (and drops any cached response, which cannot be current); a
// Response is cached for the life the claim reported; an in-flight
// answer becomes a lease lock as well (one inner Get reads the holder),
// so that one duplicate per LockTTL reaches the database during a long
// storm.
//
// The lease lock is written after the inner store granted the lease, in
// a call of its own, never by the claim script: until the inner store
// answers, the claim may yet turn out to be a replay (Redis lost the
// entry), a mismatch, another owner's lease or an error, so a duplicate
// told 409 then would be answered against the inner store's state; and
// the owner the lock names is not known before when ClaimParams.Owner is
// empty. A create thus makes three Redis calls (claim, lease lock, end), a
// replay and an in-flight duplicate one.
//
// Release, Fail and Tx.Complete go to the inner store first, then mark the
// attempt ended and compare-and-delete its lock (never a plain DEL);
// Complete also caches the stored response, for the life the attempt's
// claim reported less the time since.
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
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/redis/go-redis/v9"
)

var (
	_ idem.Store         = (*Store)(nil)
	_ idemdriver.Sweeper = (*Store)(nil)
	_ idem.Tx            = (*Tx)(nil)
)

// ErrNoSweeper is returned by Abandoned and DeleteExpired when the inner
// store does not implement idemdriver.Sweeper.
var ErrNoSweeper = errors.New("redisfront: the inner store does not implement idemdriver.Sweeper")

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
	// and one read per LockTTL). A lock learnt from an in-flight answer
	// does not know when the holder's lease ends by the inner store's
	// clock, so it may answer 409 for up to LockTTL after the lease ran
	// out. Default 1s.
	LockTTL time.Duration
	// CacheMargin is taken off the life of every cached response (besides
	// 0.1% of that life): it covers the time a Redis write takes to land
	// and the jitter of the clocks that time the record (the inner
	// store's) and the entry (Redis's). Default 1s.
	CacheMargin time.Duration
	// ClockSkew is ignored.
	//
	// Deprecated: no decision depends on the instances' wall clocks any
	// more: a cached response lives for the life the inner store reported
	// (Claim.ExpiresIn), measured on the monotonic clock, less
	// CacheMargin.
	ClockSkew time.Duration
	// Now, if set, is a test clock: the one given to the inner store
	// (memstore.Options.Now, pgstore.Options.Now) by tests that move time.
	// The Store then also checks the lease locks and cached responses it
	// reads against it, so that Redis follows a clock moved by hand. Never
	// set it in production: by default (nil) no decision reads a wall
	// clock; lifetimes come from the inner store's answers and are
	// measured with the monotonic clock.
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
	// DefaultCacheMargin is the default Options.CacheMargin.
	DefaultCacheMargin = time.Second
	// Deprecated: Options.ClockSkew is ignored.
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
	if o.CacheMargin <= 0 {
		o.CacheMargin = DefaultCacheMargin
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
// and asks the inner store everything else. It implements idemdriver.Sweeper by
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

	// Claim tokens are tokenPrefix and a sequence number: unique without
	// reading the system's random source for each claim.
	tokenPrefix string
	tokenSeq    atomic.Uint64
	// claimWaitMS and lockTTLMS are the PX arguments of claim tokens and
	// end markers, converted once.
	claimWaitMS, lockTTLMS any
}

// leaseInfo is what Claim learnt about a lease it handed out, for
// Tx.Complete to cache the response.
type leaseInfo struct {
	fingerprint string
	tag         string // ownerTag of the lease's owner
	life        life
	// forgetAt is when the lease is forgotten if it never ended here
	// (monotonic).
	forgetAt time.Time
}

// life is how long a cache entry may live.
type life struct {
	// until is when the record's life, as the inner store reported it,
	// less the margin, ends on this process's monotonic clock; zero:
	// unknown, do not cache.
	until time.Time
	// notAfter is the same end by the test clock (Options.Now), checked
	// when the entry is read; zero without a test clock.
	notAfter time.Time
}

// New returns a Store that fronts inner with rdb (a *redis.Client, a
// *redis.ClusterClient, or any redis.UniversalClient).
func New(rdb redis.UniversalClient, inner idem.Store, opts Options) *Store {
	opts = opts.withDefaults()
	claimWait := 4 * opts.Timeout
	return &Store{
		rdb:       rdb,
		inner:     inner,
		opts:      opts,
		claimWait: claimWait,
		direct:    honoursDeadlines(rdb),
		leases:    make(map[string]leaseInfo),
		nextSweep: minSweep,
		// "c|" marks a claim token (parseLock); the random part tells this
		// Store's tokens from every other's.
		tokenPrefix: claimValue(newToken() + "."),
		claimWaitMS: ms(claimWait),
		lockTTLMS:   ms(opts.LockTTL),
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
	// The hash of uvarint(len(user)) | user | key; both keys in one
	// string, PREFIX{h}:lock followed by PREFIX{h}:resp, each a part of
	// it (one allocation for the pair).
	var in [128]byte
	b := binary.AppendUvarint(in[:0], uint64(len(user)))
	b = append(b, user...)
	b = append(b, key...)
	sum := sha256.Sum256(b)
	var tag [32]byte
	hex.Encode(tag[:], sum[:16])
	var out [160]byte
	o := out[:0]
	for _, suffix := range [2]string{":lock", ":resp"} {
		o = append(o, s.opts.KeyPrefix...)
		o = append(o, '{')
		o = append(o, tag[:]...)
		o = append(o, '}')
		o = append(o, suffix...)
	}
	both := string(o)
	n := len(both) / 2
	return keys{lock: both[:n], resp: both[n:], base: both[:n-len(":lock")]}
}

// claimToken returns a fresh claim token (a lock value).
func (s *Store) claimToken() string {
	var b [64]byte
	return string(strconv.AppendUint(append(b[:0], s.tokenPrefix...), s.tokenSeq.Add(1), 36))
}

// endKey is the marker of owner's ended attempt.
func (k keys) endKey(owner string) string { return k.endKeyTag(ownerTag(owner)) }

// endKeyTag is endKey of the owner whose tag is tag.
func (k keys) endKeyTag(tag string) string { return k.base + ":end:" + tag }

// Claim implements idem.Store.
func (s *Store) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	if err := ctx.Err(); err != nil {
		return idemdriver.Claim{}, err
	}
	p = p.Normalize()
	k := s.keysFor(p.User, p.Key)
	token := s.claimToken()
	held := false
	deadline := time.Now().Add(s.claimWait)
	pause := 2 * time.Millisecond
	waited := false
	self := "" // ownerTag(p.Owner), once a lock needs it
look:
	for {
		res, err := s.run(ctx, claimScript, []string{k.lock, k.resp}, token, s.claimWaitMS)
		if err != nil {
			s.redisFailed(ctx, "claim", err)
			return s.fallback(ctx, p)
		}
		kind, val, err := claimResult(res)
		if err != nil {
			s.redisFailed(ctx, "claim", err)
			return s.fallback(ctx, p)
		}
		switch kind {
		case claimCached:
			e, err := decodeEntry(val)
			if err != nil || s.testPassed(e.notAfter) {
				break look // unreadable, or past its end by the test clock: the inner store decides
			}
			if p.Redrive != nil {
				// A completer's re-drive of an answered key: whichever
				// operation the answer is of, the listed one is not due.
				return idemdriver.Claim{}, idem.ErrNotDue
			}
			if e.fingerprint != p.Fingerprint {
				s.opts.Metrics.MismatchesFromRedis.Add(1)
				return idemdriver.Claim{}, idem.ErrFingerprintMismatch
			}
			s.opts.Metrics.ReplaysFromRedis.Add(1)
			return idemdriver.Claim{Response: e.resp}, nil
		case claimLocked:
			l, ok := parseLock(val)
			if self == "" && p.Owner != "" && ok && l.leased {
				self = ownerTag(p.Owner)
			}
			switch {
			case ok && l.leased && self != "" && l.owner == self:
				// This attempt's own lease: a claim sent again after its
				// first answer was lost. The inner store returns it.
				break look
			case ok && l.leased && l.fingerprint == p.Fingerprint && !s.testPassed(l.until):
				s.opts.Metrics.InFlightFromRedis.Add(1)
				return idemdriver.Claim{}, &idem.InFlightError{LeaseUntil: l.until}
			case ok && !l.leased && time.Now().Before(deadline):
				// Another claim is being decided: its answer, a lease
				// lock or a cached response, is what this one needs.
				if !waited {
					waited = true
					s.opts.Metrics.ClaimWaits.Add(1)
				}
				if err := sleep(ctx, min(pause, time.Until(deadline))); err != nil {
					return idemdriver.Claim{}, err
				}
				pause = min(2*pause, 20*time.Millisecond)
				continue
			}
			// Another fingerprint (a lock is not proof of a mismatch: the
			// record may have been released since), a lease run out by
			// the test clock, or a claim that takes too long: the inner
			// store decides.
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
func (s *Store) fallback(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	s.opts.Metrics.InnerClaims.Add(1)
	start, testStart := time.Now(), s.testNow()
	c, err := s.inner.Claim(ctx, p)
	if err == nil && c.Lease != nil {
		s.remember(c.Lease.Owner, p, start, s.lifeOf(start, testStart, c.ExpiresIn))
	}
	return c, err
}

// decide lets the inner store decide the claim and writes to Redis what
// it learnt. token is the claim token this call holds the lock with, or
// "". Whatever happens in Redis, the inner store's answer is returned.
func (s *Store) decide(ctx context.Context, p idemdriver.ClaimParams, k keys, token string) (idemdriver.Claim, error) {
	s.opts.Metrics.InnerClaims.Add(1)
	// The store decides after start: a life it reports, counted from
	// start, ends no later than the record's.
	start, testStart := time.Now(), s.testNow()
	c, err := s.inner.Claim(ctx, p)
	answered := time.Now()
	switch {
	case err == nil && c.Lease != nil:
		l := c.Lease
		tag := s.remember(l.Owner, p, start, s.lifeOf(start, testStart, c.ExpiresIn))
		// The lease began after start (or, for a claim sent again, before
		// it: LockTTL bounds that) and lasts p.Lease. A record without a
		// response does not expire: only the lease bounds the lock.
		if s.setLockTag(ctx, k, tag, l.Until, p.Fingerprint, p.Lease-time.Since(start)) {
			return c, err
		}
	case err == nil && c.Response != nil:
		// The fingerprint matched, or the store would have said so.
		val, px := s.entryFor(p.Fingerprint, s.lifeOf(start, testStart, c.ExpiresIn), c.Response)
		if val != "" || token != "" {
			s.fill(ctx, k, val, px, token)
			return c, err
		}
	case errors.Is(err, idem.ErrInFlight):
		// Keep what the inner store said, so that the next duplicates are
		// answered by Redis. The lock names its holder: read it. The
		// record read must be the lease the claim found live (not one
		// that ended or was taken over since). That lease was live when
		// the store answered: unless the holder's lease is longer than
		// this claim's, it ends within p.Lease of then.
		rec, gerr := s.inner.Get(ctx, p.User, p.Key)
		var ife *idem.InFlightError
		if gerr == nil && rec.Response == nil && rec.Fingerprint == p.Fingerprint && rec.Owner != "" &&
			rec.Owner != p.Owner && (!errors.As(err, &ife) || rec.LeaseUntil.Equal(ife.LeaseUntil)) &&
			s.setLockTag(ctx, k, ownerTag(rec.Owner), rec.LeaseUntil, p.Fingerprint, p.Lease-time.Since(answered)) {
			return c, err
		}
	}
	if token != "" {
		s.unlock(ctx, k, token)
	}
	return c, err
}

// setLock records in Redis that owner holds (user, key) with fingerprint
// until until (the store's lease end, told to duplicates), for at most px
// and LockTTL, unless that attempt already ended. It reports whether the
// lock was written.
func (s *Store) setLock(ctx context.Context, k keys, owner string, until time.Time, fingerprint string, px time.Duration) bool {
	return s.setLockTag(ctx, k, ownerTag(owner), until, fingerprint, px)
}

// setLockTag is setLock for the owner whose tag is tag.
func (s *Store) setLockTag(ctx context.Context, k keys, tag string, until time.Time, fingerprint string, px time.Duration) bool {
	px = min(px, s.opts.LockTTL)
	if s.opts.Now != nil {
		px = min(px, until.Sub(s.opts.Now()))
	}
	if px < time.Millisecond {
		return false
	}
	res, err := s.run(ctx, setLockScript, []string{k.lock, k.endKeyTag(tag), k.resp}, leaseTagValue(tag, until, fingerprint), ms(px))
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

// fill caches entry val (when not "") for px, and drops the claim token
// this call holds the lock with (when not "").
func (s *Store) fill(ctx context.Context, k keys, val string, px time.Duration, token string) {
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

// lifeOf is the life of a cache entry for a record that a claim sent at
// start (testStart by the test clock) reported to have expiresIn left:
// that, less the margin, counted from start. Zero when expiresIn is
// unknown or too short.
func (s *Store) lifeOf(start, testStart time.Time, expiresIn time.Duration) life {
	d := expiresIn - s.opts.CacheMargin - expiresIn/1000
	if expiresIn <= 0 || d <= 0 {
		return life{}
	}
	l := life{until: start.Add(d)}
	if !testStart.IsZero() {
		l.notAfter = testStart.Add(d)
	}
	return l
}

// entryFor encodes a cache entry and the time Redis keeps it: what is left
// of l. It returns "" when nothing is left, or l is unknown.
func (s *Store) entryFor(fingerprint string, l life, resp *idemdriver.Response) (string, time.Duration) {
	if l.until.IsZero() || resp == nil {
		return "", 0
	}
	px := time.Until(l.until)
	if px < time.Millisecond {
		return "", 0
	}
	return encodeEntry(fingerprint, l.notAfter, resp), px
}

// testNow reads the test clock, or returns zero without one.
func (s *Store) testNow() time.Time {
	if s.opts.Now == nil {
		return time.Time{}
	}
	return s.opts.Now()
}

// testPassed reports whether the test clock, if any, has reached t (a zero
// t never passes).
func (s *Store) testPassed(t time.Time) bool {
	return s.opts.Now != nil && !t.IsZero() && !s.opts.Now().Before(t)
}

// end marks l's attempt ended, caches resp (when not nil, and its life,
// as l's claim reported it, is known), and drops l's lease lock if it is
// still there. The inner store has already settled l.
func (s *Store) end(ctx context.Context, l *idemdriver.Lease, resp *idemdriver.Response) {
	li, ok := s.take(l.Owner)
	tag := li.tag
	if !ok {
		tag = ownerTag(l.Owner)
	}
	var (
		entry string
		px    time.Duration
	)
	if ok && resp != nil {
		entry, px = s.entryFor(li.fingerprint, li.life, resp)
	}
	k := s.keysFor(l.User, l.Key)
	_, err := s.run(ctx, endScript, []string{k.lock, k.endKeyTag(tag), k.resp},
		leaseTagPrefix(tag), s.lockTTLMS, entry, ms(px))
	if err != nil {
		s.redisFailed(ctx, "end", err)
		return
	}
	if entry != "" {
		s.opts.Metrics.CacheFills.Add(1)
	}
}
