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
