package redisfront

// Tests of the edges between a claim's Redis calls (claim script, lease
// lock, end script): Redis flushed or down between them, the lock racing
// other claims, a lease that ends while its handler runs; and of the
// cheaper encodings of keys, tokens, replies and entries, which must stay
// what other instances write and read.

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/redis/go-redis/v9"
)

// claimGate is an inner store whose next Claim, once armed, stops until
// released: before the inner store decides (before), or after it decided
// and committed but before its answer is returned.
type claimGate struct {
	idem.Store
	before  bool
	armed   atomic.Bool
	entered chan struct{} // closed when the gated claim stops
	release chan struct{} // closed to let it go on
}

func newClaimGate(inner idem.Store, before bool) *claimGate {
	g := &claimGate{Store: inner, before: before, entered: make(chan struct{}), release: make(chan struct{})}
	g.armed.Store(true)
	return g
}

func (g *claimGate) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	gated := g.armed.CompareAndSwap(true, false)
	if gated && g.before {
		close(g.entered)
		<-g.release
	}
	c, err := g.Store.Claim(ctx, p)
	if gated && !g.before {
		close(g.entered)
		<-g.release
	}
	return c, err
}

// failingScripts is a go-redis hook that fails the scripts whose hashes it
// holds, as a Redis that went down for those calls.
type failingScripts struct {
	mu     sync.Mutex
	hashes map[string]bool
	failed atomic.Int64
}

var errScriptDown = errors.New("redis down for this call (injected)")

func (f *failingScripts) set(scripts ...*redis.Script) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hashes = map[string]bool{}
	for _, s := range scripts {
		f.hashes[s.Hash()] = true
	}
}

func (f *failingScripts) DialHook(next redis.DialHook) redis.DialHook { return next }

func (f *failingScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		args := cmd.Args()
		if len(args) > 1 {
			name := strings.ToLower(cmd.Name())
			var hash string
			switch name {
			case "evalsha":
				hash, _ = args[1].(string)
			case "eval":
				src, _ := args[1].(string)
				hash = redis.NewScript(src).Hash()
			}
			f.mu.Lock()
			fail := f.hashes[hash]
			f.mu.Unlock()
			if fail {
				f.failed.Add(1)
				cmd.SetErr(errScriptDown)
				return errScriptDown
			}
		}
		return next(ctx, cmd)
	}
}

func (f *failingScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// claimOutcome is a Claim sent on a goroutine of its own.
type claimOutcome struct {
	c   idemdriver.Claim
	err error
}

func claimAsync(s *Store, p idemdriver.ClaimParams) <-chan claimOutcome {
	ch := make(chan claimOutcome, 1)
	go func() {
		c, err := s.Claim(context.Background(), p)
		ch <- claimOutcome{c, err}
	}()
	return ch
}

// waitUntil waits for cond, failing t after 30s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testwait.Until(t, 30*time.Second, what, cond)
}

// lockTestTimeout is the Redis timeout of the tests that check what Redis
// answers and never wait for a claim token to run out: generous, so that
// a loaded machine does not turn an answer into a fallback.
const lockTestTimeout = 5 * time.Second

func withOwner(p idemdriver.ClaimParams) idemdriver.ClaimParams {
	p.Owner = idemdriver.NewOwner()
	return p
}

// TestUndecidedClaimIsNotA409 is why the claim script cannot write the
// lease lock itself (one call instead of two): until the inner store
// answers, nobody knows the claim will get a lease. Here the key is
// completed, its cache entry is gone (Redis flushed between the calls),
// and a duplicate arrives while the first claim is with the inner store:
// it must wait and get the replay, never a 409 from Redis. A claim script
// that wrote "owner O holds the lease" before the inner store decided
// would answer it 409.
func TestUndecidedClaimIsNotA409(t *testing.T) {
	fast, ms, rdb := testStore(t, Options{Timeout: lockTestTimeout})
	ctx := context.Background()
	p := params("k", "fp")
	complete(t, fast, lease(t, fast, withOwner(p)), "done")
	k := fast.keysFor(p.User, p.Key)
	if err := rdb.Del(ctx, k.resp).Err(); err != nil {
		t.Fatal(err)
	}
	gate := newClaimGate(ms, true)
	s := New(rdb, gate, fast.opts)

	first := claimAsync(s, withOwner(p))
	<-gate.entered // the first claim holds the claim token, the inner store has not answered
	if v, _ := rdb.Get(ctx, k.lock).Result(); !strings.HasPrefix(v, "c|") {
		t.Fatalf("lock %q while the first claim is decided, want a claim token", v)
	}
	dup := claimAsync(s, withOwner(p))
	var early *claimOutcome
	waitUntil(t, "the duplicate to wait for the claim in progress", func() bool {
		select {
		case r := <-dup:
			early = &r
			return true
		default:
			return s.Metrics().ClaimWaits.Load() > 0
		}
	})
	if early != nil {
		// Only a Redis call that failed (the inner store then answers
		// alone) lets the duplicate through before the claim is decided.
		t.Errorf("the duplicate was answered (%+v, %v) while the claim was undecided; %d Redis errors",
			early.c, early.err, s.Metrics().RedisErrors.Load())
	}
	close(gate.release)
	results := map[string]claimOutcome{"first": <-first}
	if early == nil {
		results["duplicate"] = <-dup
	}
	for name, r := range results {
		if r.err != nil || r.c.Response == nil || string(r.c.Response.Body) != "done" {
			t.Errorf("%s: %+v, %v; want the replay", name, r.c, r.err)
		}
	}
	if n := s.Metrics().InFlightFromRedis.Load(); n != 0 {
		t.Errorf("%d claims answered 409 by Redis, want 0", n)
	}
}

// TestFlushBetweenClaimAndLock: Redis loses the claim token after the
// inner store granted the lease and before the lease lock is written. A
// duplicate that arrives then finds nothing, asks the inner store, is
// told 409, and writes the holder's lease lock itself; the holder's own
// lock write lands on it; one attempt runs; the completion is replayed.
func TestFlushBetweenClaimAndLock(t *testing.T) {
	fast, ms, rdb := testStore(t, Options{Timeout: lockTestTimeout})
	ctx := context.Background()
	gate := newClaimGate(ms, false)
	s := New(rdb, gate, fast.opts)
	p := params("k", "fp")
	pa := withOwner(p)
	k := s.keysFor(p.User, p.Key)

	first := claimAsync(s, pa)
	<-gate.entered // the lease is committed in the inner store, not yet known to Redis
	if err := rdb.Del(ctx, k.lock, k.resp).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Claim(ctx, withOwner(p)); !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("duplicate after the flush: %v, want ErrInFlight", err)
	}
	if v, _ := rdb.Get(ctx, k.lock).Result(); !strings.HasPrefix(v, leasePrefix(pa.Owner)) {
		t.Fatalf("lock %q after the duplicate, want the holder's lease lock", v)
	}
	close(gate.release)
	r := <-first
	if r.err != nil || r.c.Lease == nil || r.c.Lease.Owner != pa.Owner || r.c.Lease.Attempt != 1 {
		t.Fatalf("first claim: %+v, %v; want attempt 1 of %s", r.c, r.err, pa.Owner)
	}
	before := s.Metrics().InFlightFromRedis.Load()
	if _, err := s.Claim(ctx, withOwner(p)); !errors.Is(err, idem.ErrInFlight) || s.Metrics().InFlightFromRedis.Load() != before+1 {
		t.Errorf("another duplicate: %v; want ErrInFlight from Redis", err)
	}
	complete(t, s, r.c.Lease, "done")
	if c, err := s.Claim(ctx, withOwner(p)); err != nil || c.Response == nil || string(c.Response.Body) != "done" {
		t.Errorf("after completion: %+v, %v; want the replay", c, err)
	}
	if rec, err := ms.Get(ctx, p.User, p.Key); err != nil || rec.Attempts != 1 {
		t.Errorf("record %+v, %v; want one attempt", rec, err)
	}
}

// TestRedisDownBetweenCalls: Redis answers the claim script, then
// fails the lease lock and the release of the claim token; later it fails
// the end script. Every answer still comes from the inner store's state:
// the duplicate waits out the orphaned claim token and is told 409 by the
// inner store; after the lost end, the holder's lease lock (written by
// that duplicate) answers 409 for LockTTL at most, then the replay.
func TestRedisDownBetweenCalls(t *testing.T) {
	// The orphaned claim token lives 4×Timeout: 4s.
	fast, ms, rdb := testStore(t, Options{Timeout: time.Second, LockTTL: 300 * time.Millisecond})
	down := new(failingScripts)
	rdb.AddHook(down)
	s := fast
	ctx := context.Background()
	p := params("k", "fp")
	pa := withOwner(p)
	k := s.keysFor(p.User, p.Key)

	down.set(setLockScript, unlockScript)
	l := lease(t, s, pa)
	down.set()
	if down.failed.Load() != 2 {
		t.Fatalf("%d calls failed, want the lease lock and the unlock", down.failed.Load())
	}
	if v, _ := rdb.Get(ctx, k.lock).Result(); !strings.HasPrefix(v, "c|") {
		t.Fatalf("lock %q, want the orphaned claim token", v)
	}
	if _, err := s.Claim(ctx, withOwner(p)); !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("duplicate: %v, want ErrInFlight", err)
	}
	if v, _ := rdb.Get(ctx, k.lock).Result(); !strings.HasPrefix(v, leasePrefix(pa.Owner)) {
		t.Logf("lock %q after the duplicate (a Redis call of it overran the timeout?)", v)
	}

	down.set(endScript)
	complete(t, s, l, "done")
	down.set()
	// A lease lock left by the lost end misleads for LockTTL at most.
	waitUntil(t, "the replay after LockTTL", func() bool {
		c, err := s.Claim(ctx, withOwner(p))
		switch {
		case errors.Is(err, idem.ErrInFlight):
			return false
		case err != nil || c.Response == nil || string(c.Response.Body) != "done":
			t.Fatalf("after the lost end: %+v, %v; want ErrInFlight or the replay", c, err)
		}
		return true
	})
	before := s.Metrics().ReplaysFromRedis.Load()
	if c, err := s.Claim(ctx, withOwner(p)); err != nil || c.Response == nil || s.Metrics().ReplaysFromRedis.Load() != before+1 {
		t.Errorf("replay: %+v, %v; want it from Redis", c, err)
	}
	if rec, err := ms.Get(ctx, p.User, p.Key); err != nil || rec.Attempts != 1 {
		t.Errorf("record %+v, %v; want one attempt", rec, err)
	}
}

// TestLockRacesClaims: many claims of a fresh key at once, each with
// its own owner, against a slow inner store: the claim token, the lease
// lock and the inner store's decisions interleave in every order, and
// exactly one gets the lease; the others are told 409, by Redis or by the
// inner store; after the completion, all replay.
func TestLockRacesClaims(t *testing.T) {
	fast, ms, rdb := testStore(t, Options{Timeout: lockTestTimeout})
	s := New(rdb, slowClaims{ms, 10 * time.Millisecond}, fast.opts)
	ctx := context.Background()
	p := params("k", "fp")
	const n = 24
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		leases []*idemdriver.Lease
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(i%8) * 3 * time.Millisecond) // not waiting for an outcome: spreads the claims' arrivals, by design
			c, err := s.Claim(ctx, withOwner(p))
			switch {
			case err == nil && c.Lease != nil:
				mu.Lock()
				leases = append(leases, c.Lease)
				mu.Unlock()
			case !errors.Is(err, idem.ErrInFlight):
				t.Errorf("claim: %+v, %v; want a lease or ErrInFlight", c, err)
			}
		}()
	}
	wg.Wait()
	if len(leases) != 1 {
		t.Fatalf("%d leases, want 1", len(leases))
	}
	m := s.Metrics()
	t.Logf("%d inner claims, %d 409s from Redis, %d waits, %d locks", m.InnerClaims.Load(), m.InFlightFromRedis.Load(), m.ClaimWaits.Load(), m.LocksSet.Load())
	complete(t, s, leases[0], "done")
	for range 3 {
		if c, err := s.Claim(ctx, withOwner(p)); err != nil || c.Response == nil || string(c.Response.Body) != "done" {
			t.Errorf("after completion: %+v, %v; want the replay", c, err)
		}
	}
	if rec, err := ms.Get(ctx, p.User, p.Key); err != nil || rec.Attempts != 1 {
		t.Errorf("record %+v, %v; want one attempt", rec, err)
	}
}

// TestLeaseEndsWhileHandlerRuns: the lease lock never outlives the
// lease; once it ran out, another attempt takes the key over and its lock
// is written; the first attempt's late end, before or after that
// takeover, neither drops nor refuses the new lock, and its response is
// never cached.
func TestLeaseEndsWhileHandlerRuns(t *testing.T) {
	for _, order := range []string{"end after the takeover", "end before the takeover"} {
		t.Run(order, func(t *testing.T) {
			s, ms, rdb := testStore(t, Options{Timeout: lockTestTimeout, LockTTL: time.Minute})
			ctx := context.Background()
			p := params("k", "fp")
			p.Lease = 300 * time.Millisecond
			pa := withOwner(p)
			k := s.keysFor(p.User, p.Key)
			la := lease(t, s, pa)
			if pttl, err := rdb.PTTL(ctx, k.lock).Result(); err != nil || pttl <= 0 || pttl > p.Lease {
				t.Fatalf("lock PTTL %v, %v; want at most the lease (%v)", pttl, err, p.Lease)
			}
			tx, err := s.Begin(ctx, la) // the handler runs
			if err != nil {
				t.Fatal(err)
			}
			time.Sleep(p.Lease + 100*time.Millisecond) // not waiting for an outcome: Redis's clock (which cannot be faked) passes the lease's lock
			lateEnd := func() {
				if err := tx.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte("late")}); !errors.Is(err, idem.ErrFenced) {
					t.Errorf("late Complete: %v, want ErrFenced", err)
				}
				_ = s.Fail(ctx, la) // what the middleware does after a failed Complete
			}
			if order == "end before the takeover" {
				// The handler failed after its lease ran out (a late
				// Complete would still commit while nobody took over).
				_ = s.Fail(ctx, la)
			}
			pb := withOwner(p)
			pb.Lease = time.Minute
			lb := lease(t, s, pb)
			if lb.Attempt != 2 {
				t.Fatalf("takeover: attempt %d, want 2", lb.Attempt)
			}
			if order == "end after the takeover" {
				lateEnd()
			}
			if v, _ := rdb.Get(ctx, k.lock).Result(); !strings.HasPrefix(v, leasePrefix(pb.Owner)) {
				t.Fatalf("lock %q after the first attempt's late end, want the takeover's lease lock", v)
			}
			before := s.Metrics().InFlightFromRedis.Load()
			if _, err := s.Claim(ctx, withOwner(p)); !errors.Is(err, idem.ErrInFlight) || s.Metrics().InFlightFromRedis.Load() != before+1 {
				t.Errorf("duplicate of the takeover: %v; want ErrInFlight from Redis", err)
			}
			complete(t, s, lb, "second")
			for range 2 {
				if c, err := s.Claim(ctx, withOwner(p)); err != nil || c.Response == nil || string(c.Response.Body) != "second" {
					t.Errorf("after completion: %+v, %v; want the takeover's response", c, err)
				}
			}
			if rec, err := ms.Get(ctx, p.User, p.Key); err != nil || rec.Attempts != 2 || string(rec.Response.Body) != "second" {
				t.Errorf("record %+v, %v", rec, err)
			}
		})
	}
}

// TestEncodingsUnchanged: the keys, lock values and end markers built
// with fewer allocations are byte for byte what the previous code built
// (instances of both versions share one Redis during a deployment), and
// claim tokens are claim values, all different.
func TestEncodingsUnchanged(t *testing.T) {
	s := New(nil, nil, Options{KeyPrefix: "p:"})
	long := strings.Repeat("x", 300) // past keysFor's stack buffers
	for _, uk := range [][2]string{{"u", "k"}, {"", ""}, {"ab", "c"}, {long, long}, {"ü|{}", "k\x00"}} {
		user, key := uk[0], uk[1]
		h := sha256.New()
		var n [binary.MaxVarintLen64]byte
		h.Write(n[:binary.PutUvarint(n[:], uint64(len(user)))])
		h.Write([]byte(user))
		h.Write([]byte(key))
		base := "p:{" + hex.EncodeToString(h.Sum(nil))[:32] + "}"
		k := s.keysFor(user, key)
		if k.lock != base+":lock" || k.resp != base+":resp" || k.base != base || k.endKey("o") != base+":end:"+ownerTag("o") {
			t.Errorf("keysFor(%.10q, %.10q) = %+v, want base %s", user, key, k, base)
		}
	}
	until := time.Unix(0, 1_700_000_000_123_456_789)
	tag := ownerTag("owner")
	if got, want := leaseTagValue(tag, until, "fp|x"), "l|"+tag+"|1700000000123456789|fp|x"; got != want || leaseValue("owner", until, "fp|x") != want {
		t.Errorf("lease value %q, want %q", got, want)
	}
	if got := leaseTagValue(tag, time.Unix(0, -5), ""); got != "l|"+tag+"|-5|" {
		t.Errorf("lease value %q", got)
	}
	seen := map[string]bool{}
	for range 1000 {
		tok := s.claimToken()
		if l, ok := parseLock(tok); !ok || l.leased || seen[tok] {
			t.Fatalf("claim token %q: %+v, %v, seen %v", tok, l, ok, seen[tok])
		}
		seen[tok] = true
	}
	if other := New(nil, nil, Options{}).claimToken(); seen[other] || !strings.HasPrefix(other, "c|") {
		t.Errorf("another Store's token %q", other)
	}
}

// TestClaimReply: the claim script's one-string reply.
func TestClaimReply(t *testing.T) {
	for _, tc := range []struct {
		res  any
		kind int
		val  string
		bad  bool
	}{
		{res: "", kind: claimTaken},
		{res: "r\x03entry|x", kind: claimCached, val: "\x03entry|x"},
		{res: "r", kind: claimCached, val: ""},
		{res: "lc|tok", kind: claimLocked, val: "c|tok"},
		{res: "x", bad: true},
		{res: int64(0), bad: true},
		{res: []any{int64(0)}, bad: true},
		{res: nil, bad: true},
	} {
		kind, val, err := claimResult(tc.res)
		if tc.bad != (err != nil) || !tc.bad && (kind != tc.kind || val != tc.val) {
			t.Errorf("claimResult(%#v) = %d, %q, %v", tc.res, kind, val, err)
		}
	}
}

// TestVarints: the entry decoder reads varints from a string exactly as
// encoding/binary reads them from bytes, refusals included.
func TestVarints(t *testing.T) {
	cases := [][]byte{
		{}, {0}, {1}, {0x7f}, {0x80}, {0x80, 0}, {0xff, 0x01}, {0x80, 0x80},
		{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01},       // max uint64
		{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02},       // overflow
		{0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00}, // too long
		{0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00},
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 20000 {
		b := make([]byte, r.IntN(12))
		for i := range b {
			b[i] = byte(r.Uint32())
			if r.IntN(3) > 0 {
				b[i] |= 0x80
			}
		}
		cases = append(cases, b)
	}
	for range 2000 {
		v := r.Uint64() >> r.IntN(64)
		cases = append(cases, binary.AppendUvarint(nil, v), binary.AppendVarint(nil, int64(v)), binary.AppendVarint(nil, -int64(v)))
	}
	for _, b := range cases {
		in := string(append(b, "tail"...))
		want, n := binary.Uvarint([]byte(in))
		d := decoder{s: in}
		got := d.uvarint()
		if (n <= 0) != (d.err != nil) || n > 0 && (got != want || d.s != in[n:]) {
			t.Fatalf("uvarint(%x) = %d, rest %q, %v; binary.Uvarint: %d, %d", b, got, d.s, d.err, want, n)
		}
		wantS, nS := binary.Varint([]byte(in))
		d = decoder{s: in}
		gotS := d.varint()
		if (nS <= 0) != (d.err != nil) || nS > 0 && (gotS != wantS || d.s != in[nS:]) {
			t.Fatalf("varint(%x) = %d, %v; binary.Varint: %d, %d", b, gotS, d.err, wantS, nS)
		}
	}
}
