package redisfront

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/redistest"
	"github.com/idem-go/idem/memstore"
	"github.com/redis/go-redis/v9"
)

func TestEntryRoundTrip(t *testing.T) {
	exp := time.Date(2030, 1, 2, 3, 4, 5, 6, time.UTC)
	for _, tc := range []struct {
		name string
		resp *idemdriver.Response
	}{
		{"nil", &idemdriver.Response{Status: 204}},
		{"empty", &idemdriver.Response{Status: 200, Header: http.Header{}, Body: []byte{}}},
		{"full", &idemdriver.Response{Status: 201, Header: http.Header{
			"Content-Type": {"application/json"}, "X-Many": {"a", "", "b"}, "X-None": {},
		}, Body: []byte{0, 1, 2, 0xff, '|'}}},
		{"trailers", &idemdriver.Response{Status: 200, Header: http.Header{"Content-Type": {"text/plain"}},
			Body: []byte("rows"), Trailer: http.Header{"X-Checksum": {"sha256=abc"}, "X-Many": {"a", "", "b"}, "X-None": {}}}},
		{"empty trailers", &idemdriver.Response{Status: 200, Trailer: http.Header{}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			enc := encodeEntry("fp|1", exp, tc.resp)
			e, err := decodeEntry(enc)
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			got, want := e.resp, tc.resp
			if e.fingerprint != "fp|1" || !e.notAfter.Equal(exp) || got.Status != want.Status ||
				(got.Header == nil) != (want.Header == nil) || (got.Body == nil) != (want.Body == nil) ||
				!bytes.Equal(got.Body, want.Body) || len(got.Header) != len(want.Header) {
				t.Fatalf("round trip = %+v %+v, want %+v", e, got, want)
			}
			for k, vs := range want.Header {
				if g := got.Header[k]; len(g) != len(vs) || strings.Join(g, ",") != strings.Join(vs, ",") {
					t.Errorf("header %s = %q, want %q", k, g, vs)
				}
			}
			if (got.Trailer == nil) != (want.Trailer == nil) || len(got.Trailer) != len(want.Trailer) {
				t.Errorf("trailer = %#v, want %#v", got.Trailer, want.Trailer)
			}
			for k, vs := range want.Trailer {
				if g := got.Trailer[k]; len(g) != len(vs) || strings.Join(g, ",") != strings.Join(vs, ",") {
					t.Errorf("trailer %s = %q, want %q", k, g, vs)
				}
			}
			// Every truncation, and trailing bytes, are refused.
			for i := range len(enc) {
				if _, err := decodeEntry(enc[:i]); err == nil {
					t.Errorf("decode of the first %d of %d bytes succeeded", i, len(enc))
				}
			}
			if _, err := decodeEntry(enc + "x"); err == nil {
				t.Errorf("decode with a trailing byte succeeded")
			}
			// Without a test clock's end, none is read back.
			if e, err := decodeEntry(encodeEntry("fp", time.Time{}, tc.resp)); err != nil || !e.notAfter.IsZero() {
				t.Errorf("entry without an end: %+v, %v", e, err)
			}
			// A version 1 entry (whose expiry readers compared with their
			// own wall clocks) is not read.
			if _, err := decodeEntry("\x01" + enc[1:]); err == nil {
				t.Errorf("a version 1 entry was read")
			}
			// Nor a version 2 entry (without trailers: an older instance
			// would have cached an answer without the record's trailers).
			if _, err := decodeEntry("\x02" + enc[1:]); err == nil {
				t.Errorf("a version 2 entry was read")
			}
		})
	}
}

func TestParseLock(t *testing.T) {
	until := time.Date(2030, 1, 2, 3, 4, 5, 123456789, time.UTC)
	v := leaseValue("owner|with|bars", until, "fp|with|bars")
	l, ok := parseLock(v)
	if !ok || !l.leased || l.owner != ownerTag("owner|with|bars") || !l.until.Equal(until) || l.fingerprint != "fp|with|bars" {
		t.Errorf("parseLock(%q) = %+v, %v", v, l, ok)
	}
	if !strings.HasPrefix(v, leasePrefix("owner|with|bars")) || strings.HasPrefix(v, leasePrefix("owner")) {
		t.Errorf("lease prefix does not single out its owner")
	}
	if l, ok := parseLock(claimValue("tok")); !ok || l.leased {
		t.Errorf("claim value parsed as %+v, %v", l, ok)
	}
	for _, bad := range []string{"", "x", "l|", "l|a|notanumber|fp", "l|a|1"} {
		if _, ok := parseLock(bad); ok {
			t.Errorf("parseLock(%q) accepted", bad)
		}
	}
}

func TestKeys(t *testing.T) {
	s := New(nil, nil, Options{KeyPrefix: "p:"})
	a, b := s.keysFor("ab", "c"), s.keysFor("a", "bc")
	if a.lock == b.lock {
		t.Errorf("users ab/c and a/bc share a key: %s", a.lock)
	}
	tag := func(k string) string { return k[strings.Index(k, "{"):strings.Index(k, "}")] }
	if !strings.HasPrefix(a.lock, "p:{") || tag(a.lock) != tag(a.resp) || tag(a.lock) != tag(a.endKey("o")) {
		t.Errorf("keys %s, %s, %s do not share one hash tag", a.lock, a.resp, a.endKey("o"))
	}
}

// testStore returns a Store in front of a fresh memstore with the tests'
// Redis (redistest.Client), its keys under a prefix of t's own.
func testStore(t *testing.T, opts Options) (*Store, *memstore.Store, *redis.Client) {
	t.Helper()
	rdb := redistest.Client(t, "redisfront")
	opts.KeyPrefix = redistest.Prefix(t, rdb, "idemtest")
	if opts.Timeout == 0 {
		// These tests check what Redis answers, not the deadline: on a
		// loaded CI machine a call may overrun the default 50ms.
		opts.Timeout = time.Second
	}
	ms := memstore.New(memstore.Options{})
	return New(rdb, ms, opts), ms, rdb
}

func params(key, fp string) idemdriver.ClaimParams {
	return idemdriver.ClaimParams{User: "u", Key: key, Fingerprint: fp, Method: "POST", Path: "/x", Lease: 10 * time.Second, TTL: time.Hour}
}

func complete(t *testing.T, s idem.Store, l *idemdriver.Lease, body string) {
	t.Helper()
	tx, err := s.Begin(context.Background(), l)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(context.Background(), &idemdriver.Response{Status: 201, Body: []byte(body)}); err != nil {
		t.Fatal(err)
	}
}

func lease(t *testing.T, s idem.Store, p idemdriver.ClaimParams) *idemdriver.Lease {
	t.Helper()
	c, err := s.Claim(context.Background(), p)
	if err != nil || c.Lease == nil {
		t.Fatalf("Claim = %+v, %v; want a lease", c, err)
	}
	return c.Lease
}

// TestStaleLockIsBounded: a completion Redis never heard of (here the
// inner store's transaction completed behind its back) leaves a lock that
// answers 409 for LockTTL at most; then the inner store's replay is
// answered, and cached.
func TestStaleLockIsBounded(t *testing.T) {
	s, ms, _ := testStore(t, Options{LockTTL: 200 * time.Millisecond})
	ctx := context.Background()
	p := params("k", "fp")
	l := lease(t, s, p)
	complete(t, ms, l, "done") // not through s: Redis keeps the lock
	if _, err := s.Claim(ctx, p); !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("claim with the stale lock: %v, want ErrInFlight (from Redis)", err)
	}
	time.Sleep(250 * time.Millisecond) // not waiting for an outcome: Redis's clock (which cannot be faked) passes LockTTL
	for i := range 2 {
		c, err := s.Claim(ctx, p)
		if err != nil || c.Response == nil || string(c.Response.Body) != "done" {
			t.Fatalf("claim %d after LockTTL = %+v, %v; want the replay", i, c, err)
		}
	}
	if n := s.Metrics().ReplaysFromRedis.Load(); n != 1 {
		t.Errorf("replays from Redis = %d, want 1 (the second claim)", n)
	}
}

// TestLateLockRefused: once an attempt ended, a lease lock for it that
// arrives late (a duplicate read the database just before the end) is
// refused.
func TestLateLockRefused(t *testing.T) {
	s, _, rdb := testStore(t, Options{})
	ctx := context.Background()
	p := params("k", "fp")
	l := lease(t, s, p)
	k := s.keysFor(p.User, p.Key)
	if err := s.Fail(ctx, l); err != nil {
		t.Fatal(err)
	}
	if s.setLock(ctx, k, l.Owner, l.Until, p.Fingerprint, time.Minute) {
		t.Errorf("a lock for the ended attempt was written")
	}
	if n, _ := rdb.Exists(ctx, k.lock).Result(); n != 0 {
		t.Errorf("lock still there after Fail")
	}
	// The same request runs again at once: a new attempt, a new lock.
	l2 := lease(t, s, p)
	if l2.Attempt != 2 {
		t.Errorf("retry Attempt = %d, want 2", l2.Attempt)
	}
	if _, err := s.Claim(ctx, p); !errors.Is(err, idem.ErrInFlight) || s.Metrics().InFlightFromRedis.Load() != 1 {
		t.Errorf("duplicate of the retry: %v, %d from Redis; want ErrInFlight from Redis", err, s.Metrics().InFlightFromRedis.Load())
	}
}

// slowClaims is an inner store whose claims take a while.
type slowClaims struct {
	idem.Store
	d time.Duration
}

func (s slowClaims) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	time.Sleep(s.d) // not waiting for an outcome: the inner store's latency, by design
	return s.Store.Claim(ctx, p)
}

// TestReplayStormAfterFlush: repeats of a completed key whose cache entry
// is gone are all replays, though they arrive while one of them asks the
// (slow) inner store: none is told 409, and they wait for its answer
// rather than all asking the inner store.
func TestReplayStormAfterFlush(t *testing.T) {
	fast, ms, rdb := testStore(t, Options{})
	s := New(rdb, slowClaims{ms, 20 * time.Millisecond}, fast.opts)
	ctx := context.Background()
	p := params("k", "fp")
	complete(t, s, lease(t, s, p), "done")
	if err := rdb.Del(ctx, s.keysFor(p.User, p.Key).resp).Err(); err != nil {
		t.Fatal(err)
	}
	before := s.Metrics().InnerClaims.Load()
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			c, err := s.Claim(ctx, p)
			if err != nil || c.Response == nil {
				t.Errorf("Claim = %+v, %v; want the replay", c, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	m := s.Metrics()
	inner := m.InnerClaims.Load() - before
	t.Logf("%d inner claims, %d replays from Redis, %d waits", inner, m.ReplaysFromRedis.Load(), m.ClaimWaits.Load())
	if m.ClaimWaits.Load() == 0 || inner > 5 {
		t.Errorf("%d waits, %d inner claims: want the claims to wait for one inner claim", m.ClaimWaits.Load(), inner)
	}
}

// TestRedisCannotDecide: whatever Redis holds that a Store did not write
// as it should, or that is out of date, the inner store decides. (The
// Store has a test clock, here the real one, against which it also checks
// what it reads.)
func TestRedisCannotDecide(t *testing.T) {
	s, _, rdb := testStore(t, Options{Now: time.Now})
	ctx := context.Background()
	now := time.Now()
	resp := &idemdriver.Response{Status: 201, Body: []byte("cached")}
	v1 := encodeEntry("fp", time.Time{}, resp)
	v1 = "\x01" + v1[1:]
	for _, tc := range []struct {
		name       string
		lock, resp string
	}{
		{"garbage", "garbage", "garbage"},
		{"entry of version 1", "", v1},
		{"entry of version 2", "", "\x02" + v1[1:]},
		{"entry past its end by the test clock", "", encodeEntry("fp", now.Add(-time.Second), resp)},
		{"lease run out by the test clock", leaseValue("o", now.Add(-time.Millisecond), "fp"), ""},
		{"lease of another fingerprint", leaseValue("o", now.Add(time.Hour), "other"), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := params(tc.name, "fp")
			k := s.keysFor(p.User, p.Key)
			for key, v := range map[string]string{k.lock: tc.lock, k.resp: tc.resp} {
				if v != "" {
					rdb.Set(ctx, key, v, time.Minute)
				}
			}
			// A free key: the inner store hands out a lease.
			c, err := s.Claim(ctx, p)
			if err != nil || c.Lease == nil {
				t.Fatalf("Claim = %+v, %v; want a lease", c, err)
			}
		})
	}
}

// noSweeper is an idem.Store that is not an idemdriver.Sweeper.
type noSweeper struct{ idem.Store }

func TestSweeperDelegation(t *testing.T) {
	s := New(nil, noSweeper{memstore.New(memstore.Options{})}, Options{})
	if _, err := s.Abandoned(context.Background(), idemdriver.AbandonedParams{Limit: 1}); !errors.Is(err, ErrNoSweeper) {
		t.Errorf("Abandoned: %v, want ErrNoSweeper", err)
	}
	if _, err := s.DeleteExpired(context.Background(), 1); !errors.Is(err, ErrNoSweeper) {
		t.Errorf("DeleteExpired: %v, want ErrNoSweeper", err)
	}
}
