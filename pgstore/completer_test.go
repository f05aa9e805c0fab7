package pgstore_test

// Adversarial review of issue 8 (second review): interleavings of the
// completer with client retries, expiry and clocks, on real PostgreSQL.

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// effectsHandler is a handler that writes one effects row per committed
// run, named after the operation (key and the record's creation time in
// microseconds, which is what the order service derives its payment key
// from), and answers 201.
func effectsHandler(t *testing.T, hold func(l *idemdriver.Lease)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		l, ok := idem.LeaseFromContext(r.Context())
		if !ok {
			t.Errorf("handler without a lease")
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		if hold != nil {
			hold(l)
		}
		tx, err := pgstore.FromContext(r.Context())
		if err != nil {
			t.Errorf("FromContext: %v", err)
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		name := fmt.Sprintf("%s|%d", l.Key, l.CreatedAt.UnixMicro())
		if _, err := tx.Exec(r.Context(), `INSERT INTO effects (name) VALUES ($1)`, name); err != nil {
			t.Errorf("insert effect: %v", err)
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"op":%q}`, name)
	})
}

// effectsOf returns the committed effects of key: one per operation run.
func effectsOf(t *testing.T, pool *pgxpool.Pool, key string) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT name FROM effects WHERE name LIKE $1 ORDER BY name`, key+"|%")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s)
	}
	return out
}

// crashedAttempt claims key as an attempt whose instance then died: the
// record keeps the request, its lease runs out after lease.
func crashedAttempt(t *testing.T, s idem.Store, user, key, body string, lease, ttl time.Duration) idemdriver.ClaimParams {
	t.Helper()
	fp, err := idem.Fingerprint(httptest.NewRequest("POST", "/v1/things", nil), []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	p := idemdriver.ClaimParams{
		User: user, Key: key, Fingerprint: fp, Owner: idemdriver.NewOwner(),
		Method: "POST", Path: "/v1/things", Header: http.Header{"Content-Type": {"application/json"}},
		Body: []byte(body), Lease: lease, TTL: ttl,
	}
	c, err := s.Claim(context.Background(), p)
	if err != nil || c.Lease == nil {
		t.Fatalf("Claim %s = %+v, %v; want a lease", key, c, err)
	}
	return p
}

// TestCompleterStaleListingStartsNoNewOperation checks that a record the
// completer listed, finished and expired before its re-drive is not re-run
// as a new operation: the work commits once.
//
// It guards a bug found in the second review of issue 8, as it was found: the completer
// re-drives the records Abandoned listed, one after the other, by sending
// each stored request through the middleware as a new claim. A record
// that was finished (by the client's retry) and then expired while the
// completer was busy with the records before it is no longer abandoned,
// but the completer's claim replaces it (a completed record whose expiry
// passed starts a new operation: a new CreatedAt, so a new payment key)
// and runs the request a second time, although the client sent it once and
// got its answer. The same happens when the record was deleted meanwhile
// (the cleaner, or a Release): the claim inserts a new record.
//
// Interleaving: k1 and k2 are abandoned (lease ran out); the completer
// lists both and re-drives k1 first (slow: a gateway call); meanwhile the
// client retries k2, which completes (201, one effect); k2's TTL passes;
// the completer reaches k2 and runs it again as a new operation: a second
// effect under another CreatedAt (for the order service: a second order
// and a second charge, with a new derived payment key).
func TestCompleterStaleListingStartsNoNewOperation(t *testing.T) {
	t.Parallel()
	pool := migratedPool(t)
	store := pgstore.New(pool, pgstore.Options{}) // the database's clock, as in production
	ctx := context.Background()
	const ttl = 1500 * time.Millisecond

	entered := make(chan struct{})
	release := make(chan struct{})
	var once sync.Once
	handler := effectsHandler(t, func(l *idemdriver.Lease) {
		if l.Key == "k1" {
			once.Do(func() { close(entered) })
			select { // the completer's slow re-drive of k1
			case <-release:
			case <-time.After(20 * time.Second):
			}
		}
	})
	opts := idem.Options{Lease: time.Second, TTL: ttl, User: func(r *http.Request) string { return r.Header.Get("X-User") }}

	crashedAttempt(t, store, "alice", "k1", `{"n":1}`, 100*time.Millisecond, time.Hour)
	time.Sleep(5 * time.Millisecond) // not waiting for an outcome: the database's clock (as in production) moves, so k2 is created after k1 and listed after it
	crashedAttempt(t, store, "alice", "k2", `{"n":2}`, 100*time.Millisecond, ttl)
	time.Sleep(300 * time.Millisecond) // not waiting for an outcome: the database's clock (as in production) passes both leases

	c := idem.NewCompleter(store, handler, idem.CompleterOptions{Middleware: opts})
	done := make(chan idem.CompleterStats, 1)
	go func() {
		st, err := c.RunOnce(ctx)
		if err != nil {
			t.Errorf("RunOnce: %v", err)
		}
		done <- st
	}()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the completer never re-drove k1")
	}

	// The client's retry of k2 finishes it.
	srv := httptest.NewServer(idem.Middleware(store, opts)(handler))
	defer srv.Close()
	req, _ := http.NewRequest("POST", srv.URL+"/v1/things", strings.NewReader(`{"n":2}`))
	req.Header.Set("X-User", "alice")
	req.Header.Set("Idempotency-Key", "k2")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("client retry of k2: %d, want 201", resp.StatusCode)
	}
	// k2 is finished; its TTL (counted from its first use) passes while the
	// completer is still busy with k1.
	time.Sleep(ttl + 200*time.Millisecond) // not waiting for an outcome: the database's clock (as in production) passes k2's TTL
	close(release)
	var st idem.CompleterStats
	select {
	case st = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("RunOnce did not return")
	}

	got := effectsOf(t, pool, "k2")
	if len(got) != 1 {
		t.Errorf("k2 was sent once by its client and answered 201, but its handler's work committed %d times: %v (completer %+v); "+
			"the completer's claim from a stale Abandoned list started a new operation (new CreatedAt: a new payment key)", len(got), got, st)
	}
}

// TestCompleterFollowsDatabaseClock checks that the completer's backoff
// follows the database's clock, not the process's, so an abandoned attempt
// is finished one lease after it ended.
//
// It guards a bug found in the second review of issue 8, as it was found: Abandoned lists a record by the
// database's clock (its lease ran out), but RunOnce then skips it unless
// time.Now() - rec.LeaseUntil reaches the backoff, which compares this
// process's clock with a database time. On an instance whose clock is
// behind the database's (here by an hour), an abandoned attempt (which may
// have paid) is skipped for as long as the skew: its payment stays
// without its order far longer than the one lease that invariant 2
// allows. The database's clock is put an hour ahead of this process's
// with skewedPool.
func TestCompleterFollowsDatabaseClock(t *testing.T) {
	t.Parallel()
	pool := skewedPool(t, time.Hour)
	store := pgstore.New(pool, pgstore.Options{}) // production: the database's clock decides
	ctx := context.Background()
	handler := effectsHandler(t, nil)
	opts := idem.Options{Lease: 10 * time.Second, TTL: time.Hour, User: func(r *http.Request) string { return r.Header.Get("X-User") }}

	crashedAttempt(t, store, "alice", "k-skew", `{"n":1}`, 100*time.Millisecond, time.Hour)
	time.Sleep(300 * time.Millisecond) // not waiting for an outcome: the skewed database clock, which cannot be faked, passes the lease

	if recs, err := store.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10}); err != nil || len(recs) != 1 {
		t.Fatalf("Abandoned = %d records, %v; want the crashed attempt", len(recs), err)
	}
	c := idem.NewCompleter(store, handler, idem.CompleterOptions{Middleware: opts})
	st, err := c.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Completed != 1 || len(effectsOf(t, pool, "k-skew")) != 1 {
		t.Errorf("RunOnce = %+v, effects %v; want the abandoned attempt finished one lease after it ended "+
			"(it is skipped until this process's clock reaches the database's lease end: an hour)", st, effectsOf(t, pool, "k-skew"))
	}
}
