package memstore

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/storetest"
)

// completeSmall claims and completes key with a small response.
func completeSmall(t *testing.T, s *Store, user, key string, ttl time.Duration) {
	t.Helper()
	ctx := context.Background()
	c, err := s.Claim(ctx, idemdriver.ClaimParams{User: user, Key: key, Fingerprint: "fp", Owner: "o-" + key, TTL: ttl})
	if err != nil || c.Lease == nil {
		t.Fatalf("claim %s: %+v, %v", key, c, err)
	}
	tx, err := s.Begin(ctx, c.Lease)
	if err != nil {
		t.Fatal(err)
	}
	resp := &idemdriver.Response{Status: 201, Header: http.Header{"Content-Type": {"text/plain"}}, Body: []byte("answer of " + key)}
	if err := tx.Complete(ctx, resp); err != nil {
		t.Fatalf("complete %s: %v", key, err)
	}
}

// TestArenaFreesChunksEmptiedWhileAppendedTo: records that expire and are
// deleted while their chunk is still the one appended to must not leave
// that chunk held forever once the arena moves on to a new one. With short
// TTLs and a frequent sweeper, every chunk is emptied while it is current.
func TestArenaFreesChunksEmptiedWhileAppendedTo(t *testing.T) {
	clock := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	s := New(Options{Now: clock.Now})
	ctx := context.Background()
	for i := range 20000 {
		completeSmall(t, s, "u", fmt.Sprintf("key-%d", i), time.Second)
		clock.Advance(2 * time.Second)
		if n, err := s.DeleteExpired(ctx, 100); err != nil || n != 1 {
			t.Fatalf("DeleteExpired = %d, %v", n, err)
		}
	}
	if s.Len() != 0 {
		t.Fatalf("%d records left", s.Len())
	}
	held, chunks := 0, 0
	for i, c := range s.arena.chunks {
		if c != nil {
			chunks++
			held += cap(c)
			if i != s.arena.cur && s.arena.live[i] == 0 {
				t.Errorf("chunk %d (%d bytes) holds no live record and is not the one appended to", i, cap(c))
			}
		}
	}
	if chunks > 2 {
		t.Errorf("an empty store holds %d chunks, %d bytes", chunks, held)
	}
}

// replayBody claims (user, key) with fingerprint "fp" and returns the
// replayed body; it fails the test when the claim is not a replay.
func replayBody(t *testing.T, s *Store, user, key string) string {
	t.Helper()
	c, err := s.Claim(context.Background(), idemdriver.ClaimParams{User: user, Key: key, Fingerprint: "fp", Owner: "other", TTL: time.Hour})
	if err != nil || c.Response == nil {
		t.Fatalf("claim (%q, %q): %+v, %v", user, key, c, err)
	}
	return string(c.Response.Body)
}

// TestCompletedUserKeyBoundaries: pairs whose user and key concatenate to
// the same bytes, or are empty, are different records, also when all their
// hashes clash.
func TestCompletedUserKeyBoundaries(t *testing.T) {
	pairs := [][2]string{{"a|b", "c"}, {"a", "b|c"}, {"ab", "c"}, {"a", "bc"}, {"", "abc"}, {"abc", ""}, {"", ""}, {"\x01", ""}, {"", "\x01"}}
	for _, mask := range []uint64{^uint64(0), 0} {
		s := New(Options{})
		s.mask = mask
		for _, p := range pairs {
			completeSmall(t, s, p[0], p[1], time.Hour)
		}
		for _, p := range pairs {
			if got, want := replayBody(t, s, p[0], p[1]), "answer of "+p[1]; got != want {
				t.Errorf("mask %x: (%q, %q) replayed %q", mask, p[0], p[1], got)
			}
			rec, err := s.Get(context.Background(), p[0], p[1])
			if err != nil || rec.User != p[0] || rec.Key != p[1] {
				t.Errorf("mask %x: Get(%q, %q) = %+v, %v", mask, p[0], p[1], rec, err)
			}
		}
	}
}

// TestClashingExpiredRecordReplacedOtherReplayed: of two completed records
// with the same hash, the expired one is claimed again and completed anew
// while the other one, in the clash map or in done, keeps replaying its own
// answer.
func TestClashingExpiredRecordReplacedOtherReplayed(t *testing.T) {
	for _, expireFirst := range []bool{true, false} {
		clock := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
		s := New(Options{Now: clock.Now})
		s.mask = 0
		short, long := "k1", "k2"
		if !expireFirst {
			short, long = long, short
		}
		ttl := func(key string) time.Duration {
			if key == short {
				return time.Hour
			}
			return 3 * time.Hour
		}
		completeSmall(t, s, "u", "k1", ttl("k1"))
		completeSmall(t, s, "u", "k2", ttl("k2"))
		clock.Advance(2 * time.Hour)
		ctx := context.Background()
		c, err := s.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: short, Fingerprint: "fp2", Owner: "again", TTL: time.Hour})
		if err != nil || c.Lease == nil {
			t.Fatalf("claim of expired %s: %+v, %v", short, c, err)
		}
		if got := replayBody(t, s, "u", long); got != "answer of "+long {
			t.Fatalf("%s replayed %q", long, got)
		}
		tx, _ := s.Begin(ctx, c.Lease)
		if err := tx.Complete(ctx, &idemdriver.Response{Status: 200, Body: []byte("new")}); err != nil {
			t.Fatal(err)
		}
		c, err = s.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: short, Fingerprint: "fp2", Owner: "x", TTL: time.Hour})
		if err != nil || c.Response == nil || string(c.Response.Body) != "new" {
			t.Fatalf("replay of %s: %+v, %v", short, c, err)
		}
		if got := replayBody(t, s, "u", long); got != "answer of "+long {
			t.Fatalf("%s replayed %q", long, got)
		}
		if _, err := s.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: short, Fingerprint: "fp", Owner: "y", TTL: time.Hour}); err == nil {
			t.Fatalf("the old fingerprint of %s was accepted", short)
		}
		checkArena(t, s)
	}
}

// TestFencedCompleteKeepsNewerRecord: the Complete of a lease taken over is
// fenced, before and after the new owner's Complete, and changes nothing.
func TestFencedCompleteKeepsNewerRecord(t *testing.T) {
	for _, newFirst := range []bool{true, false} {
		clock := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
		s := New(Options{Now: clock.Now})
		ctx := context.Background()
		p := idemdriver.ClaimParams{User: "u", Key: "k", Fingerprint: "fp", Owner: "old", TTL: time.Hour, Lease: time.Second}
		c1, err := s.Claim(ctx, p)
		if err != nil || c1.Lease == nil {
			t.Fatal(c1, err)
		}
		tx1, _ := s.Begin(ctx, c1.Lease)
		clock.Advance(2 * time.Second)
		p.Owner = "new"
		c2, err := s.Claim(ctx, p)
		if err != nil || c2.Lease == nil {
			t.Fatal(c2, err)
		}
		tx2, _ := s.Begin(ctx, c2.Lease)
		if newFirst {
			if err := tx2.Complete(ctx, &idemdriver.Response{Status: 200, Body: []byte("new")}); err != nil {
				t.Fatal(err)
			}
		}
		if err := tx1.Complete(ctx, &idemdriver.Response{Status: 500, Body: []byte("old")}); err == nil {
			t.Fatal("the fenced Complete succeeded")
		}
		if !newFirst {
			if err := tx2.Complete(ctx, &idemdriver.Response{Status: 200, Body: []byte("new")}); err != nil {
				t.Fatal(err)
			}
		}
		if got := replayBody(t, s, "u", "k"); got != "new" {
			t.Fatalf("replayed %q", got)
		}
		if s.Len() != 1 {
			t.Fatalf("%d records", s.Len())
		}
	}
}

// TestReplaysDuringCompaction: replays of long-lived records, whose chunks
// the expiry of the short-lived records around them compacts and frees,
// answer their own record throughout (run with -race).
func TestReplaysDuringCompaction(t *testing.T) {
	clock := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	s := New(Options{Now: clock.Now})
	s.mask = 7 // clashes too
	ctx := context.Background()
	const keep = 50
	for i := range 2000 {
		if i%40 == 0 {
			completeSmall(t, s, "keep", fmt.Sprintf("k%d", i/40), 10000*time.Hour)
		} else {
			completeSmall(t, s, "churn", fmt.Sprintf("c%d", i), time.Second)
		}
	}
	done := make(chan struct{})
	errs := make(chan error, 8)
	for g := range 4 {
		go func() {
			for n := 0; ; n++ {
				select {
				case <-done:
					errs <- nil
					return
				default:
				}
				key := fmt.Sprintf("k%d", (n+g)%keep)
				c, err := s.Claim(ctx, idemdriver.ClaimParams{User: "keep", Key: key, Fingerprint: "fp", Owner: "r", TTL: time.Hour})
				if err != nil || c.Response == nil || string(c.Response.Body) != "answer of "+key {
					errs <- fmt.Errorf("replay of %s: %+v, %v", key, c, err)
					return
				}
				c.Response.Body[0] = 'X' // a copy
				c.Response.Header.Set("Content-Type", "spoiled")
			}
		}()
	}
	for i := range 3000 {
		clock.Advance(2 * time.Second)
		if _, err := s.DeleteExpired(ctx, 1000); err != nil {
			t.Fatal(err)
		}
		completeSmall(t, s, "churn", fmt.Sprintf("d%d", i), time.Second)
	}
	close(done)
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for i := range keep {
		key := fmt.Sprintf("k%d", i)
		if got := replayBody(t, s, "keep", key); got != "answer of "+key {
			t.Fatalf("%s replayed %q", key, got)
		}
	}
	checkArena(t, s)
}

// TestClockLocationsKept: a clock whose times each carry a new *Location
// of the same zone (time.FixedZone per call) does not grow the store's
// table of locations with every record.
func TestClockLocationsKept(t *testing.T) {
	start := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	s := New(Options{Now: func() time.Time { return start.In(time.FixedZone("Z", 3600)) }})
	for i := range 200 {
		completeSmall(t, s, "u", fmt.Sprintf("k%d", i), time.Hour)
	}
	if len(s.locs) > 10 {
		t.Errorf("%d locations kept after 200 records", len(s.locs))
	}
	rec, err := s.Get(context.Background(), "u", "k0")
	if err != nil {
		t.Fatal(err)
	}
	if name, off := rec.CompletedAt.Zone(); name != "Z" || off != 3600 || !rec.CompletedAt.Equal(start) {
		t.Errorf("completed at %v", rec.CompletedAt)
	}
}
