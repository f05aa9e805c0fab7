package pgstore_test

// Second reading of 843adee (pgstore under REPEATABLE READ and
// SERIALIZABLE): Claim reads a serialization failure or deadlock of its
// conditional statements as "the row changed", and Tx.Complete, refused
// that way, answers idem.ErrFenced only when the key's row, read again,
// belongs to another attempt or is gone. These tests pin what that must
// and must not mean.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/storetest"
)

// strictConfig is one way a handler's transaction ends up at a strict
// isolation: the database's default (the pool's
// default_transaction_isolation, which the claim statements get too), or
// Options.TxOptions on a READ COMMITTED pool (the claims stay READ
// COMMITTED).
type strictConfig struct {
	name  string
	level string // default_transaction_isolation, "" for READ COMMITTED
	iso   pgx.TxIsoLevel
}

var strictConfigs = []strictConfig{
	{name: "default repeatable read", level: "repeatable read"},
	{name: "default serializable", level: "serializable"},
	{name: "TxOptions repeatable read", iso: pgx.RepeatableRead},
	{name: "TxOptions serializable", iso: pgx.Serializable},
}

func (c strictConfig) serializable() bool {
	return c.level == "serializable" || c.iso == pgx.Serializable
}

func (c strictConfig) pool(t *testing.T) *pgxpool.Pool {
	if c.level == "" {
		return migratedPool(t)
	}
	return skewIsolatedPool(t, c.level)
}

func (c strictConfig) store(pool *pgxpool.Pool, now func() time.Time) *pgstore.Store {
	return pgstore.New(pool, pgstore.Options{Now: now, TxOptions: pgx.TxOptions{IsoLevel: c.iso}})
}

// strictQuiet discards the middleware's logs (the refused completions
// are counted instead).
var strictQuiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// sqlStateOf is the SQLSTATE that err wraps, or "".
func sqlStateOf(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

func strictEffects(t *testing.T, pool *pgxpool.Pool, like string) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT name FROM effects WHERE name LIKE $1 ORDER BY name`, like)
	if err != nil {
		t.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return names
}

func strictClaim(t *testing.T, s *pgstore.Store, key string, lease time.Duration) *idemdriver.Lease {
	t.Helper()
	c, err := s.Claim(context.Background(), idemdriver.ClaimParams{User: "u", Key: key, Fingerprint: "fp", Method: "POST", Path: "/",
		Owner: idemdriver.NewOwner(), Lease: lease, TTL: time.Hour})
	if err != nil || c.Lease == nil {
		t.Fatalf("claim %s: %+v, %v", key, c, err)
	}
	return c.Lease
}

func strictWrite(t *testing.T, tx idem.Tx, name string) {
	t.Helper()
	if _, err := tx.(*pgstore.Tx).PgxTx().Exec(context.Background(), `INSERT INTO effects (name) VALUES ($1)`, name); err != nil {
		t.Fatalf("writing %s: %v", name, err)
	}
}

// TestFencedCompleteUnderIsolation: an attempt takes its snapshot,
// its lease runs out, a retry takes the key over. Under every strict
// configuration the late attempt's Complete is refused with a
// serialization failure and answered idem.ErrFenced, the 40001 still
// reachable with errors.As; nothing of it committed; its Fail finds the
// key another's (ErrFenced) and so changes nothing; the retry completes
// and its answer is the stored one. The "gone" variant: the retry
// completed, the record expired and was cleaned before the late
// Complete; it is ErrFenced too, and the cleaned key is free.
func TestFencedCompleteUnderIsolation(t *testing.T) {
	for _, cfg := range strictConfigs {
		for _, gone := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/gone=%v", cfg.name, gone), func(t *testing.T) {
				ctx := context.Background()
				pool := cfg.pool(t)
				clock := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
				s := cfg.store(pool, clock.Now)
				a := strictClaim(t, s, "k", time.Second)
				txA, err := s.Begin(ctx, a)
				if err != nil {
					t.Fatal(err)
				}
				strictWrite(t, txA, "k/a") // the snapshot is taken here
				clock.Advance(2 * time.Second)
				b := strictClaim(t, s, "k", time.Second)
				if b.Attempt != 2 {
					t.Fatalf("retry's lease %+v, want attempt 2 (a takeover)", b)
				}
				if gone {
					txB, err := s.Begin(ctx, b)
					if err != nil {
						t.Fatal(err)
					}
					strictWrite(t, txB, "k/b")
					if err := txB.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte("b")}); err != nil {
						t.Fatalf("retry's Complete: %v", err)
					}
					clock.Advance(2 * time.Hour)
					if n, err := s.DeleteExpired(ctx, 10); err != nil || n != 1 {
						t.Fatalf("DeleteExpired: %d, %v; want 1", n, err)
					}
				}
				err = txA.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte("a")})
				if !errors.Is(err, idem.ErrFenced) {
					t.Fatalf("late Complete: %v, want ErrFenced", err)
				}
				if code := sqlStateOf(err); code != "40001" {
					t.Errorf("late Complete: %v carries SQLSTATE %q, want 40001 (refused by the snapshot)", err, code)
				}
				if got := strictEffects(t, pool, "k/a"); len(got) != 0 {
					t.Fatalf("the fenced attempt's effect committed: %v", got)
				}
				if err := s.Fail(ctx, a); !errors.Is(err, idem.ErrFenced) {
					t.Errorf("Fail of the fenced attempt: %v, want ErrFenced", err)
				}
				if gone {
					if _, err := s.Get(ctx, "u", "k"); !errors.Is(err, idem.ErrNotFound) {
						t.Errorf("Get of the cleaned key: %v, want ErrNotFound", err)
					}
					return
				}
				rec, err := s.Get(ctx, "u", "k")
				if err != nil || rec.Owner != b.Owner || rec.Response != nil {
					t.Fatalf("record after the fenced Complete: %+v, %v; want the retry's lease, unanswered", rec, err)
				}
				txB, err := s.Begin(ctx, b)
				if err != nil {
					t.Fatal(err)
				}
				strictWrite(t, txB, "k/b")
				if err := txB.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte("b")}); err != nil {
					t.Fatalf("retry's Complete: %v", err)
				}
				if got := strictEffects(t, pool, "k/%"); len(got) != 1 || got[0] != "k/b" {
					t.Errorf("effects %v, want only the retry's", got)
				}
				if rec, err := s.Get(ctx, "u", "k"); err != nil || rec.Response == nil || string(rec.Response.Body) != "b" {
					t.Errorf("stored answer %+v, %v; want the retry's", rec, err)
				}
			})
		}
	}
}

// writeSkew runs two attempts on keys k1 and k2 whose handlers
// each read what the other writes, then write (a write skew): under
// SERIALIZABLE the second to complete is refused (40001) although both
// still own their keys. It returns the two Complete errors.
func writeSkew(t *testing.T, s *pgstore.Store, l1, l2 *idemdriver.Lease) (err1, err2 error) {
	t.Helper()
	ctx := context.Background()
	tx1, err := s.Begin(ctx, l1)
	if err != nil {
		t.Fatal(err)
	}
	tx2, err := s.Begin(ctx, l2)
	if err != nil {
		t.Fatal(err)
	}
	p1, p2 := tx1.(*pgstore.Tx).PgxTx(), tx2.(*pgstore.Tx).PgxTx()
	var n int
	if err := p1.QueryRow(ctx, `SELECT count(*) FROM effects WHERE name LIKE 'k2/%'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if err := p2.QueryRow(ctx, `SELECT count(*) FROM effects WHERE name LIKE 'k1/%'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	strictWrite(t, tx1, "k1/"+l1.Owner)
	strictWrite(t, tx2, "k2/"+l2.Owner)
	err1 = tx1.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte(l1.Owner)})
	err2 = tx2.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte(l2.Owner)})
	return err1, err2
}

// TestCommitRefusedStillOwned: under SERIALIZABLE (the database's
// default, or TxOptions), a completion refused because of the handler's
// own writes (a write skew with another key's attempt), not the key's
// row, is not ErrFenced: the attempt still owns the key, so the error is
// returned (40001 reachable), nothing of it committed, its Fail succeeds
// (the lease ends now), and the retry takes the key over as attempt 2
// and commits exactly once.
func TestCommitRefusedStillOwned(t *testing.T) {
	for _, cfg := range strictConfigs {
		if !cfg.serializable() {
			continue
		}
		t.Run(cfg.name, func(t *testing.T) {
			ctx := context.Background()
			pool := cfg.pool(t)
			s := cfg.store(pool, nil)
			l1, l2 := strictClaim(t, s, "k1", time.Minute), strictClaim(t, s, "k2", time.Minute)
			err1, err2 := writeSkew(t, s, l1, l2)
			if err1 != nil {
				t.Fatalf("first Complete: %v", err1)
			}
			if err2 == nil || errors.Is(err2, idem.ErrFenced) || sqlStateOf(err2) != "40001" {
				t.Fatalf("second Complete: %v (SQLSTATE %q); want the 40001 itself, not ErrFenced", err2, sqlStateOf(err2))
			}
			if got := strictEffects(t, pool, "k2/%"); len(got) != 0 {
				t.Fatalf("the refused attempt's effect committed: %v", got)
			}
			rec, err := s.Get(ctx, "u", "k2")
			if err != nil || rec.Owner != l2.Owner || rec.Response != nil {
				t.Fatalf("k2 after the refused Complete: %+v, %v; want still the attempt's, unanswered", rec, err)
			}
			if err := s.Fail(ctx, l2); err != nil {
				t.Fatalf("Fail of the refused attempt: %v, want nil (it still owns the key)", err)
			}
			l3 := strictClaim(t, s, "k2", time.Minute)
			if l3.Attempt != 2 {
				t.Fatalf("retry's lease %+v, want attempt 2", l3)
			}
			tx3, err := s.Begin(ctx, l3)
			if err != nil {
				t.Fatal(err)
			}
			strictWrite(t, tx3, "k2/"+l3.Owner)
			if err := tx3.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte(l3.Owner)}); err != nil {
				t.Fatalf("retry's Complete: %v", err)
			}
			if got := strictEffects(t, pool, "k2/%"); len(got) != 1 || got[0] != "k2/"+l3.Owner {
				t.Errorf("k2 effects %v, want only the retry's", got)
			}
			if got := strictEffects(t, pool, "k1/%"); len(got) != 1 || got[0] != "k1/"+l1.Owner {
				t.Errorf("k1 effects %v, want only the first attempt's", got)
			}
		})
	}
}

// TestMiddlewareCommitRefusedIs503 is the same write skew through the
// middleware: the refused request is answered 503 (not 409), its lease
// is failed at once (not left held until it runs out), the client's
// retry runs it as attempt 2 and gets 201, and every later repeat
// replays that answer. Exactly one effect per key.
func TestMiddlewareCommitRefusedIs503(t *testing.T) {
	for _, cfg := range strictConfigs {
		if !cfg.serializable() {
			continue
		}
		t.Run(cfg.name, func(t *testing.T) {
			ctx := context.Background()
			pool := cfg.pool(t)
			s := cfg.store(pool, nil)
			var read, wrote sync.WaitGroup
			read.Add(2)
			wrote.Add(2)
			k1Done := make(chan struct{})
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				key := r.Header.Get("Idempotency-Key")
				l, _ := idem.LeaseFromContext(r.Context())
				tx, err := pgstore.FromContext(r.Context())
				if err != nil {
					w.WriteHeader(http.StatusInternalServerError)
					return
				}
				other := map[string]string{"k1": "k2/%", "k2": "k1/%"}[key]
				var n int
				if err := tx.QueryRow(r.Context(), `SELECT count(*) FROM effects WHERE name LIKE $1`, other).Scan(&n); err != nil {
					w.WriteHeader(http.StatusServiceUnavailable)
					return
				}
				if l.Attempt == 1 {
					read.Done()
					read.Wait()
				}
				_, err = tx.Exec(r.Context(), `INSERT INTO effects (name) VALUES ($1)`, key+"/"+l.Owner)
				if l.Attempt == 1 {
					wrote.Done()
					wrote.Wait()
				}
				if err != nil {
					w.WriteHeader(http.StatusServiceUnavailable)
					return
				}
				if key == "k2" && l.Attempt == 1 {
					<-k1Done // complete after k1 committed
				}
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, l.Owner)
			})
			metrics := new(idem.Metrics)
			srv := httptest.NewServer(idem.Middleware(s, idem.Options{User: idem.SharedKeySpace, Metrics: metrics, Lease: time.Minute, Logger: strictQuiet})(h))
			defer srv.Close()
			post := func(key string) (int, string) {
				req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
				req.Header.Set("Idempotency-Key", key)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Errorf("POST %s: %v", key, err)
					return -1, ""
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				return resp.StatusCode, string(b)
			}
			var st1, st2 int
			var wg sync.WaitGroup
			wg.Add(2)
			go func() { defer wg.Done(); st1, _ = post("k1"); close(k1Done) }()
			go func() { defer wg.Done(); st2, _ = post("k2") }()
			wg.Wait()
			if st1 != http.StatusCreated || st2 != http.StatusServiceUnavailable {
				t.Fatalf("statuses k1 %d, k2 %d; want 201 and 503", st1, st2)
			}
			if metrics.Fenced.Load() != 0 || metrics.Failed.Load() != 1 {
				t.Errorf("metrics fenced %d failed %d; want 0 and 1", metrics.Fenced.Load(), metrics.Failed.Load())
			}
			rec, err := s.Get(ctx, "u", "k2")
			if err == nil {
				t.Logf("k2 after the 503: %+v", rec)
			}
			st, body := post("k2")
			if st != http.StatusCreated || body == "" {
				t.Fatalf("retry of k2: %d %q, want 201 at once (the lease was failed)", st, body)
			}
			if st2, body2 := post("k2"); st2 != http.StatusCreated || body2 != body {
				t.Errorf("repeat of k2: %d %q, want the replay of %q", st2, body2, body)
			}
			for _, k := range []string{"k1", "k2"} {
				if got := strictEffects(t, pool, k+"/%"); len(got) != 1 {
					t.Errorf("%s effects %v, want exactly one", k, got)
				}
			}
			if got := strictEffects(t, pool, "k2/%"); len(got) == 1 && got[0] != "k2/"+body {
				t.Errorf("k2 effect %v but the client saw %q", got, body)
			}
		})
	}
}

// checkingStore records, for every Complete, whether its answer
// agrees with the database right after: ErrFenced only when the key's row
// is another attempt's or gone (owners never come back, so a row owned by
// the attempt after a fenced answer is a wrong ErrFenced), and the
// attempt's effect committed exactly when Complete returned nil.
type checkingStore struct {
	*pgstore.Store
	pool                         *pgxpool.Pool
	ok, fenced, refused, serials atomic.Int64
	mu                           sync.Mutex
	wrong                        []string
}

func (s *checkingStore) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	tx, err := s.Store.Begin(ctx, l)
	if err != nil {
		return nil, err
	}
	return &checkingTx{Tx: tx.(*pgstore.Tx), s: s, l: l}, nil
}

type checkingTx struct {
	*pgstore.Tx
	s *checkingStore
	l *idemdriver.Lease
}

func (tx *checkingTx) Unwrap() idem.Tx { return tx.Tx }

func (tx *checkingTx) Complete(ctx context.Context, resp *idemdriver.Response) error {
	err := tx.Tx.Complete(ctx, resp)
	s, l := tx.s, tx.l
	if sqlStateOf(err) == "40001" || sqlStateOf(err) == "40P01" {
		s.serials.Add(1)
	}
	var owner string
	var effects int
	var qerr error
	// The check is a statement of its own, under the database's default
	// isolation too: SERIALIZABLE may refuse it (40001) like any other;
	// it changes nothing, so it is sent again.
	for range 20 {
		qerr = s.pool.QueryRow(context.Background(), `
SELECT coalesce((SELECT owner FROM idempotency_keys WHERE user_id = $1 AND key = $2), ''),
	(SELECT count(*) FROM effects WHERE name = $2 || '/' || $3)`, l.User, l.Key, l.Owner).Scan(&owner, &effects)
		if c := sqlStateOf(qerr); c != "40001" && c != "40P01" {
			break
		}
	}
	bad := func(f string, a ...any) {
		s.mu.Lock()
		s.wrong = append(s.wrong, fmt.Sprintf("%s attempt %d: ", l.Key, l.Attempt)+fmt.Sprintf(f, a...))
		s.mu.Unlock()
	}
	switch {
	case qerr != nil:
		bad("checking: %v", qerr)
	case err == nil:
		s.ok.Add(1)
		if effects != 1 || owner != l.Owner {
			bad("completed, but %d effects and owner %q", effects, owner)
		}
	case errors.Is(err, idem.ErrFenced):
		s.fenced.Add(1)
		if owner == l.Owner {
			bad("ErrFenced (%v) while it still owns the key", err)
		}
		if effects != 0 {
			bad("ErrFenced (%v) but its effect committed", err)
		}
	default:
		s.refused.Add(1)
		if effects != 0 {
			bad("error %v but its effect committed", err)
		}
	}
	return err
}

// TestHammerUnderStrictIsolation: under each strict configuration, 10 keys × 3
// clients through the middleware, with a lease (150 ms) shorter than some
// handlers run (up to 250 ms), so attempts are taken over while they run
// (their Complete refused by the snapshot), and handlers that read the
// whole effects table before writing (so SERIALIZABLE refuses some
// statements and commits); a completer re-drives abandoned keys at the
// same time. Each client sends its key until it gets 201 (at most 400
// times). Every Complete's answer is checked against the database right
// after it (checkingStore); at the end every key has exactly one
// effect, made by the attempt whose answer is stored, and every 201 a
// client saw is that answer.
func TestHammerUnderStrictIsolation(t *testing.T) {
	for _, cfg := range strictConfigs {
		t.Run(cfg.name, func(t *testing.T) {
			ctx := context.Background()
			pool := cfg.pool(t)
			cs := &checkingStore{Store: cfg.store(pool, nil), pool: pool}
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				// The lease's key: the completer sends the header as a
				// structured-field string ("h1", quoted).
				l, _ := idem.LeaseFromContext(r.Context())
				key := l.Key
				tx, err := pgstore.FromContext(r.Context())
				if err != nil {
					w.WriteHeader(http.StatusInternalServerError)
					return
				}
				var n int
				if err := tx.QueryRow(r.Context(), `SELECT count(*) FROM effects`).Scan(&n); err != nil {
					w.WriteHeader(http.StatusServiceUnavailable)
					return
				}
				if _, err := tx.Exec(r.Context(), `INSERT INTO effects (name) VALUES ($1)`, key+"/"+l.Owner); err != nil {
					w.WriteHeader(http.StatusServiceUnavailable)
					return
				}
				time.Sleep(time.Duration(rand.IntN(250)) * time.Millisecond) // not waiting for an outcome: the handler's work outlasts the lease at random, by design
				w.WriteHeader(http.StatusCreated)
				io.WriteString(w, l.Owner)
			})
			mo := idem.Options{User: idem.SharedKeySpace, Lease: 150 * time.Millisecond, TTL: time.Hour, Logger: strictQuiet}
			srv := httptest.NewServer(idem.Middleware(cs, mo)(h))
			defer srv.Close()
			comp := idem.NewCompleter(cs, h, idem.CompleterOptions{Middleware: mo, Logger: strictQuiet, Backoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, MaxAttempts: 1000})
			cctx, stop := context.WithCancel(ctx)
			compDone := make(chan struct{})
			var scans atomic.Int64
			go func() {
				defer close(compDone)
				for i := 0; i < 2000 && cctx.Err() == nil; i++ {
					_, _ = comp.RunOnce(cctx) // its errors are not what this test checks
					scans.Add(1)
					time.Sleep(20 * time.Millisecond) // not waiting for an outcome: paces the completer's scans
				}
			}()

			const keys, clients, tries = 10, 3, 400
			type seen struct {
				key, body string
			}
			var (
				mu       sync.Mutex
				saw      []seen
				statuses = map[int]int{}
				wg       sync.WaitGroup
			)
			for k := range keys {
				for range clients {
					wg.Add(1)
					go func() {
						defer wg.Done()
						key := fmt.Sprintf("h%d", k)
						for range tries {
							req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"k":"`+key+`"}`))
							req.Header.Set("Idempotency-Key", key)
							resp, err := http.DefaultClient.Do(req)
							if err != nil {
								t.Errorf("POST %s: %v", key, err)
								return
							}
							b, _ := io.ReadAll(resp.Body)
							resp.Body.Close()
							mu.Lock()
							statuses[resp.StatusCode]++
							if resp.StatusCode == http.StatusCreated {
								saw = append(saw, seen{key, string(b)})
							}
							mu.Unlock()
							if resp.StatusCode == http.StatusCreated {
								return
							}
							time.Sleep(time.Duration(5+rand.IntN(20)) * time.Millisecond) // not waiting for an outcome: a client's pause between its bounded retries
						}
						t.Errorf("%s: no 201 after %d tries", key, tries)
					}()
				}
			}
			wg.Wait()
			stop()
			<-compDone
			t.Logf("%s: answers %v; completes ok %d, fenced %d, refused %d (%d of them 40001/40P01); completer scans %d",
				cfg.name, statuses, cs.ok.Load(), cs.fenced.Load(), cs.refused.Load(), cs.serials.Load(), scans.Load())
			for _, w := range cs.wrong {
				t.Errorf("wrong Complete answer: %s", w)
			}
			stored := map[string]string{}
			for k := range keys {
				key := fmt.Sprintf("h%d", k)
				rec, err := cs.Get(ctx, "", key) // the middleware's default user
				if err != nil || rec.Response == nil {
					t.Errorf("%s: record %+v, %v: lost or not answered", key, rec, err)
					continue
				}
				stored[key] = string(rec.Response.Body)
				effects := strictEffects(t, pool, key+"/%")
				if len(effects) != 1 || effects[0] != key+"/"+stored[key] {
					t.Errorf("%s: effects %v, stored answer %q: want exactly the stored attempt's", key, effects, stored[key])
				}
			}
			for _, s := range saw {
				if stored[s.key] != s.body {
					t.Errorf("%s: a client saw 201 %q, stored %q", s.key, s.body, stored[s.key])
				}
			}
		})
	}
}

// TestBareClaimRaceUnderIsolation: 8 claims of one key at once (each with its own
// owner, never resent), for 25 keys, under each strict configuration, on
// the bare store: exactly one lease per key and ErrInFlight for every
// other claim, never a raw 40001/40P01 (Claim reads again after one) nor
// errContention. Then the lease's Complete, and a further claim replays.
func TestBareClaimRaceUnderIsolation(t *testing.T) {
	for _, cfg := range strictConfigs {
		t.Run(cfg.name, func(t *testing.T) {
			ctx := context.Background()
			pool := cfg.pool(t)
			s := cfg.store(pool, nil)
			const keys, racers = 25, 8
			var leases, inflight atomic.Int64
			for k := range keys {
				p := idemdriver.ClaimParams{User: "u", Key: fmt.Sprintf("r%d", k), Fingerprint: "fp", Method: "POST", Path: "/", Lease: time.Minute, TTL: time.Hour}
				var (
					mu  sync.Mutex
					won []*idemdriver.Lease
					wg  sync.WaitGroup
				)
				start := make(chan struct{})
				for range racers {
					wg.Add(1)
					go func() {
						defer wg.Done()
						q := p
						q.Owner = idemdriver.NewOwner()
						<-start
						c, err := s.Claim(ctx, q)
						switch {
						case err == nil && c.Lease != nil:
							leases.Add(1)
							mu.Lock()
							won = append(won, c.Lease)
							mu.Unlock()
						case errors.Is(err, idem.ErrInFlight):
							inflight.Add(1)
						default:
							t.Errorf("claim of %s: %+v, %v (SQLSTATE %q)", q.Key, c, err, sqlStateOf(err))
						}
					}()
				}
				close(start)
				wg.Wait()
				if len(won) != 1 {
					t.Fatalf("%s: %d leases, want 1", p.Key, len(won))
				}
				tx, err := s.Begin(ctx, won[0])
				if err != nil {
					t.Fatal(err)
				}
				strictWrite(t, tx, p.Key+"/"+won[0].Owner)
				if err := tx.Complete(ctx, &idemdriver.Response{Status: 201, Body: []byte(won[0].Owner)}); err != nil {
					t.Fatalf("Complete %s: %v", p.Key, err)
				}
				p.Owner = idemdriver.NewOwner()
				if c, err := s.Claim(ctx, p); err != nil || c.Response == nil || string(c.Response.Body) != won[0].Owner {
					t.Errorf("claim after completion of %s: %+v, %v; want the replay", p.Key, c, err)
				}
			}
			t.Logf("%s: %d leases, %d in flight", cfg.name, leases.Load(), inflight.Load())
			if leases.Load() != keys || inflight.Load() != keys*(racers-1) {
				t.Errorf("want %d leases and %d in flight", keys, keys*(racers-1))
			}
		})
	}
}
