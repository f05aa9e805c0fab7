package memstore

// The encoded completed records (completed.go): what is decoded is what
// was completed, through clashing hashes, expiry deletes and the arena's
// compaction.

import (
	"context"
	"fmt"
	"net/http"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/storetest"
)

// TestConformanceClashing runs the conformance suite on stores whose
// completed records all have the same hash: every one but the first is
// found by its user and key (Store.clash).
func TestConformanceClashing(t *testing.T) {
	var mu sync.Mutex
	effects := map[string]int{}
	clashing := func(s *Store) *Store { s.mask = 0; return s }
	storetest.Run(t, storetest.Harness{
		New: func(t *testing.T) idem.Store { return clashing(New(Options{})) },
		NewAt: func(t *testing.T, now func() time.Time) idem.Store {
			return clashing(New(Options{Now: now}))
		},
		Write: func(ctx context.Context, tx idem.Tx, name string) error {
			idemdriver.UnwrapTx(tx).(*Tx).OnCommit(func() {
				mu.Lock()
				defer mu.Unlock()
				effects[name]++
			})
			return nil
		},
		HandlerCommit: func(ctx context.Context) error {
			tx, err := FromContext(ctx)
			if err != nil {
				return err
			}
			return tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK})
		},
		HandlerRollback: func(ctx context.Context) error {
			tx, err := FromContext(ctx)
			if err != nil {
				return err
			}
			return tx.Rollback(ctx)
		},
		Count: func(ctx context.Context, s idem.Store, name string) (int, error) {
			mu.Lock()
			defer mu.Unlock()
			return effects[name], nil
		},
	})
}

// long reports whether record i is kept 2 hours; the others, 1.
func long(i int) bool { return i%10 == 0 }

// completedCase is the request and response of record i: headers with
// nil and empty values, nil and empty bodies and trailers, sizes up to
// more than a chunk.
func completedCase(i int) (idemdriver.ClaimParams, *idemdriver.Response) {
	p := idemdriver.ClaimParams{
		User: fmt.Sprintf("user-%d", i%7), Key: fmt.Sprintf("key-%d", i), Fingerprint: fmt.Sprintf("fp-%d", i),
		Owner: fmt.Sprintf("owner-%d", i), Method: "POST", Path: fmt.Sprintf("/v1/things/%d", i%3),
		Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"a":1}`),
		TTL: time.Hour,
	}
	if long(i) {
		p.TTL = 2 * time.Hour
	}
	resp := &idemdriver.Response{Status: 200 + i%5, Header: http.Header{"Content-Type": {"application/json"}}}
	switch i % 6 {
	case 0:
		resp.Header["Location"] = []string{fmt.Sprintf("/v1/things/%d", i)}
		resp.Body = []byte(fmt.Sprintf(`{"id":%d}`, i))
	case 1:
		resp.Header = nil
		resp.Body = []byte{}
		resp.Trailer = http.Header{}
	case 2:
		resp.Header["X-Empty"] = []string{}
		resp.Header["X-Nil"] = nil
		resp.Trailer = http.Header{"X-Sum": {"a", "b"}}
	case 3:
		resp.Header = http.Header{}
		for j := range 12 {
			resp.Header[fmt.Sprintf("X-H%d", j)] = []string{fmt.Sprint(j), fmt.Sprint(i)}
		}
		resp.Body = make([]byte, 300+i)
	case 4:
		p.Header = nil
		p.User = ""
	case 5:
		if i%30 == 5 {
			resp.Body = make([]byte, maxChunk+i) // a chunk of its own
		}
	}
	return p, resp
}

func completeCase(t *testing.T, s *Store, i int) {
	t.Helper()
	ctx := context.Background()
	p, resp := completedCase(i)
	c, err := s.Claim(ctx, p)
	if err != nil || c.Lease == nil {
		t.Fatalf("claim %d: %+v, %v", i, c, err)
	}
	tx, err := s.Begin(ctx, c.Lease)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, resp); err != nil {
		t.Fatalf("complete %d: %v", i, err)
	}
}

// checkCase checks what the store hands out of record i, completed at
// completed, and spoils it.
func checkCase(t *testing.T, s *Store, i int, completed time.Time) {
	t.Helper()
	ctx := context.Background()
	p, want := completedCase(i)
	rec, err := s.Get(ctx, p.User, p.Key)
	if err != nil {
		t.Fatalf("get %d: %v", i, err)
	}
	if rec.User != p.User || rec.Key != p.Key || rec.Fingerprint != p.Fingerprint || rec.Method != p.Method ||
		rec.Path != p.Path || rec.Owner != p.Owner || rec.Body != nil || rec.Attempts != 1 || rec.Redrives != 0 ||
		!reflect.DeepEqual(rec.Header, p.Header) {
		t.Fatalf("record %d: %+v", i, rec)
	}
	if rec.CompletedAt != completed || rec.ExpiresAt != rec.CreatedAt.Add(p.TTL) || rec.LeaseUntil != rec.CreatedAt.Add(idemdriver.DefaultLease) {
		t.Fatalf("record %d: times %v %v %v %v, completed at %v", i, rec.CreatedAt, rec.LeaseUntil, rec.CompletedAt, rec.ExpiresAt, completed)
	}
	p.Owner = "another"
	c, err := s.Claim(ctx, p)
	if err != nil {
		t.Fatalf("replay %d: %v", i, err)
	}
	for _, got := range []*idemdriver.Response{rec.Response, c.Response} {
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("response %d: %#v, want %#v", i, got, want)
		}
		for k, v := range got.Header {
			for j := range v {
				v[j] = "spoiled"
			}
			got.Header[k+"-Added"] = nil
		}
		for j := range got.Body {
			got.Body[j] = '!'
		}
	}
}

// checkArena checks the arena's accounts: every record found is in a
// chunk, the chunks' live bytes are those of the records found in them.
func checkArena(t *testing.T, s *Store) {
	t.Helper()
	live := make([]int, len(s.arena.chunks))
	count := func(sl slot) {
		if s.arena.chunks[sl.chunk] == nil {
			t.Fatalf("a record in freed chunk %d", sl.chunk)
		}
		live[sl.chunk] += len(s.arena.get(sl))
	}
	for _, sl := range s.done {
		count(sl)
	}
	for _, sl := range s.clash {
		count(sl)
	}
	if !reflect.DeepEqual(live, s.arena.live) {
		t.Fatalf("live bytes %v, counted %v", s.arena.live, live)
	}
}

// arenaBytes is the room of the arena's chunks.
func arenaBytes(s *Store) int {
	n := 0
	for _, c := range s.arena.chunks {
		n += cap(c)
	}
	return n
}

func TestCompletedRecords(t *testing.T) {
	for _, mask := range []uint64{^uint64(0), 3} {
		t.Run(fmt.Sprintf("mask %x", mask), func(t *testing.T) {
			loc := time.FixedZone("X", 3600)
			clock := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 6, loc))
			s := New(Options{Now: clock.Now})
			s.mask = mask
			const n = 600
			completed := make([]time.Time, 2*n)
			for i := range n {
				completeCase(t, s, i)
				completed[i] = clock.Now()
				clock.Advance(time.Millisecond)
			}
			checkArena(t, s)
			for i := range n {
				checkCase(t, s, i, completed[i])
				checkCase(t, s, i, completed[i]) // the spoiled copies changed nothing
			}
			before := arenaBytes(s)
			clock.Advance(90 * time.Minute) // the records not long expire
			if got, err := s.DeleteExpired(context.Background(), 10); err != nil || got != 10 {
				t.Fatalf("DeleteExpired(10) = %d, %v", got, err)
			}
			if got, err := s.DeleteExpired(context.Background(), n); err != nil || got != n*9/10-10 {
				t.Fatalf("DeleteExpired = %d, %v", got, err)
			}
			checkArena(t, s)
			if s.Len() != n/10 {
				t.Fatalf("%d records, want %d", s.Len(), n/10)
			}
			if after := arenaBytes(s); after*3 > before {
				t.Errorf("the arena holds %d bytes after the expiry of 90 %% of its records, %d before", after, before)
			}
			for i := range n {
				if !long(i) {
					p, _ := completedCase(i)
					if _, err := s.Get(context.Background(), p.User, p.Key); err == nil {
						t.Fatalf("expired record %d found", i)
					}
					continue
				}
				checkCase(t, s, i, completed[i])
			}
			for i := n; i < 2*n; i++ { // in the freed chunks too
				completeCase(t, s, i)
				completed[i] = clock.Now()
			}
			checkArena(t, s)
			for i := range 2 * n {
				if i >= n || long(i) {
					checkCase(t, s, i, completed[i])
				}
			}
			clock.Advance(3 * time.Hour)
			if got, err := s.DeleteExpired(context.Background(), 2*n); err != nil || got != n/10+n {
				t.Fatalf("DeleteExpired = %d, %v", got, err)
			}
			checkArena(t, s)
			if s.Len() != 0 || len(s.done) != 0 || len(s.clash) != 0 {
				t.Fatalf("%d records left", s.Len())
			}
		})
	}
}

// An expired completed record is made again by a new claim, in place of
// the old one, which a clashing record's lookup must not find.
func TestCompletedRecordClaimedAgain(t *testing.T) {
	clock := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	s := New(Options{Now: clock.Now})
	s.mask = 0
	for i := range 6 {
		completeCase(t, s, i)
	}
	clock.Advance(90 * time.Minute) // all but record 0 expired
	for i := range 6 {
		p, _ := completedCase(i)
		c, err := s.Claim(context.Background(), p)
		switch {
		case err != nil:
			t.Fatal(err)
		case !long(i) && c.Lease == nil, long(i) && c.Response == nil:
			t.Fatalf("record %d: %+v", i, c)
		}
	}
	if s.Len() != 6 || len(s.recs) != 5 {
		t.Fatalf("%d records, %d in flight", s.Len(), len(s.recs))
	}
	checkArena(t, s)
}

// Times keep their instant and location: UTC, Local, another.
func TestCompletedTimes(t *testing.T) {
	for _, start := range []time.Time{
		time.Date(2030, 1, 2, 3, 4, 5, 999999999, time.UTC),
		time.Date(2030, 1, 2, 3, 4, 5, 1, time.Local),
		time.Date(1950, 1, 2, 3, 4, 5, 1, time.FixedZone("Y", -7200)),
		time.Now(),
	} {
		clock := storetest.NewClock(start)
		s := New(Options{Now: clock.Now})
		completeCase(t, s, 0)
		rec, err := s.Get(context.Background(), "user-0", "key-0")
		if err != nil {
			t.Fatal(err)
		}
		if want := start.Round(0); rec.CreatedAt != want || rec.CompletedAt != want {
			t.Errorf("%v: created %v, completed %v", start, rec.CreatedAt, rec.CompletedAt)
		}
	}
}
