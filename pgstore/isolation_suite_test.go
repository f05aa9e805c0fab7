package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/storetest"
)

// skewIsolationLevels are the database defaults, besides READ COMMITTED,
// under which the store must keep every guarantee (issue 10, point 4).
var skewIsolationLevels = []string{"repeatable read", "serializable"}

// skewIsolatedPool is migratedPool on a fresh schema whose connections
// all start their transactions, the store's autocommit statements
// included, at level: the pool's default_transaction_isolation, as a
// database or role default would set it.
func skewIsolatedPool(t *testing.T, level string) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = level
	})
	ctx := context.Background()
	var got string
	if err := pool.QueryRow(ctx, `SHOW default_transaction_isolation`).Scan(&got); err != nil || got != level {
		t.Fatalf("default_transaction_isolation = %q (%v), want %q", got, err, level)
	}
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate under %s: %v", level, err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (name text NOT NULL)`); err != nil {
		t.Fatalf("creating effects: %v", err)
	}
	return pool
}

// skewSerializationFailure reports whether err is PostgreSQL's 40001 (or
// 40P01, a deadlock, which the same retry cures).
func skewSerializationFailure(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == "40001" || pe.Code == "40P01")
}

// skewResendingStore is a pgstore.Store read as the middleware reads it
// under a strict isolation: a Claim that fails with a serialization
// failure is sent again with the same owner token (idem's retry sends a
// failed store call again, 10 ms doubling, for up to 2 s), and a
// Tx.Complete that fails with one committed nothing, exactly as a fenced
// one, and is reported as ErrFenced (the middleware answers it 503 and
// fails the lease; the client's retry gets the outcome of whoever holds
// the key). The suite then checks what matters: that nothing committed,
// and that exactly one other attempt took the key. The bare store
// returns these 40001s to its caller (see the report of issue 10,
// point 4, and TestConformanceStrictIsolation).
type skewResendingStore struct {
	*pgstore.Store
	resent, serialFails *atomic.Int64
}

func (s skewResendingStore) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	if p.Owner == "" {
		p.Owner = idemdriver.NewOwner()
	}
	for try := 0; ; try++ {
		c, err := s.Store.Claim(ctx, p)
		if !skewSerializationFailure(err) || try >= 20 {
			return c, err
		}
		s.resent.Add(1)
	}
}

func (s skewResendingStore) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	tx, err := s.Store.Begin(ctx, l)
	if err != nil {
		return nil, err
	}
	return skewTx{tx.(*pgstore.Tx), s.serialFails}, nil
}

// skewTx is a pgstore.Tx whose Complete reports a serialization failure
// (nothing committed) as ErrFenced; see skewResendingStore.
type skewTx struct {
	*pgstore.Tx
	serialFails *atomic.Int64
}

func (tx skewTx) Complete(ctx context.Context, resp *idemdriver.Response) error {
	err := tx.Tx.Complete(ctx, resp)
	if skewSerializationFailure(err) {
		tx.serialFails.Add(1)
		return fmt.Errorf("%w (serialization failure: %w)", idem.ErrFenced, err)
	}
	return err
}

func (tx skewTx) Unwrap() idem.Tx { return tx.Tx }

// skewConformance runs the conformance suite on stores whose pools start
// every transaction at level; wrap, if set, wraps each store.
func skewConformance(t *testing.T, level string, wrap func(*pgstore.Store) idem.Store) {
	var pools sync.Map // idem.Store → *pgxpool.Pool
	newStore := func(t *testing.T, now func() time.Time) idem.Store {
		pool := skewIsolatedPool(t, level)
		var s idem.Store = pgstore.New(pool, pgstore.Options{Now: now})
		if wrap != nil {
			s = wrap(s.(*pgstore.Store))
		}
		pools.Store(s, pool)
		t.Cleanup(func() { pools.Delete(s) })
		return s
	}
	storetest.Run(t, storetest.Harness{
		New:   func(t *testing.T) idem.Store { return newStore(t, nil) },
		NewAt: newStore,
		Write: func(ctx context.Context, tx idem.Tx, name string) error {
			_, err := idemdriver.UnwrapTx(tx).(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, name)
			return err
		},
		Count: func(ctx context.Context, s idem.Store, name string) (int, error) {
			pool, _ := pools.Load(s)
			var n int
			err := pool.(*pgxpool.Pool).QueryRow(ctx, `SELECT count(*) FROM effects WHERE name = $1`, name).Scan(&n)
			return n, err
		},
	})
}

// TestConformanceUnderIsolation runs the whole conformance suite with the
// database's default isolation at REPEATABLE READ and at SERIALIZABLE,
// each claim that fails with a serialization failure sent again as the
// middleware sends it, and a completion refused by one read as one that
// committed nothing (skewResendingStore). Every case passes: the failures
// cost a resend or a 503, never a second execution or a lost key. How
// many there were is logged.
func TestConformanceUnderIsolation(t *testing.T) {
	for _, level := range skewIsolationLevels {
		t.Run(level, func(t *testing.T) {
			resent, serialFails := new(atomic.Int64), new(atomic.Int64)
			skewConformance(t, level, func(s *pgstore.Store) idem.Store { return skewResendingStore{s, resent, serialFails} })
			// The suite's cases run in parallel, after this function returns.
			t.Cleanup(func() {
				t.Logf("%s: %d claims resent after a serialization failure; %d completions refused by one (nothing committed)", level, resent.Load(), serialFails.Load())
			})
		})
	}
}

// TestClaimRaceStoreUnderIsolation: 8 claims of one key at once, for 30
// keys, straight on the store. Whatever the isolation, exactly one claim
// per key gets a lease; every other one gets ErrInFlight or a
// serialization failure, which, sent again with the same owner as the
// middleware sends it, also gets ErrInFlight (never a second lease). The
// one lease then completes, and every claim after that replays: no key
// is executed twice, none is lost.
func TestClaimRaceStoreUnderIsolation(t *testing.T) {
	for _, level := range skewIsolationLevels {
		t.Run(level, func(t *testing.T) {
			pool := skewIsolatedPool(t, level)
			s := pgstore.New(pool, pgstore.Options{})
			ctx := context.Background()
			const keys, racers = 30, 8
			var leases, inflight, serial, other atomic.Int64
			for k := range keys {
				p := idemdriver.ClaimParams{User: "u", Key: fmt.Sprintf("race-%d", k), Fingerprint: "fp", Method: "POST", Path: "/", Lease: time.Minute, TTL: time.Hour}
				var won []*idemdriver.Lease
				var mu sync.Mutex
				var wg sync.WaitGroup
				start := make(chan struct{})
				for range racers {
					wg.Add(1)
					go func() {
						defer wg.Done()
						q := p
						q.Owner = idemdriver.NewOwner()
						<-start
						for try := 0; ; try++ {
							c, err := s.Claim(ctx, q)
							switch {
							case err == nil && c.Lease != nil:
								leases.Add(1)
								mu.Lock()
								won = append(won, c.Lease)
								mu.Unlock()
							case errors.Is(err, idem.ErrInFlight):
								inflight.Add(1)
							case skewSerializationFailure(err) && try < 20:
								serial.Add(1)
								continue // as the middleware does: the same claim again
							default:
								other.Add(1)
								t.Errorf("claim of %s: %+v, %v", q.Key, c, err)
							}
							return
						}
					}()
				}
				close(start)
				wg.Wait()
				if len(won) != 1 {
					t.Fatalf("key %s: %d leases, want 1", p.Key, len(won))
				}
				tx, err := s.Begin(ctx, won[0])
				if err != nil {
					t.Fatal(err)
				}
				if _, err := tx.(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, p.Key); err != nil {
					t.Fatal(err)
				}
				if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusCreated, Body: []byte(p.Key)}); err != nil {
					t.Fatalf("Complete %s: %v", p.Key, err)
				}
				p.Owner = idemdriver.NewOwner()
				if c, err := s.Claim(ctx, p); err != nil || c.Response == nil || string(c.Response.Body) != p.Key {
					t.Errorf("claim after completion of %s: %+v, %v; want the replay", p.Key, c, err)
				}
			}
			var effects, distinct int
			if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT name) FROM effects`).Scan(&effects, &distinct); err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: %d keys × %d racers: %d leases, %d in flight, %d serialization failures sent again, %d other; effects %d (%d distinct)",
				level, keys, racers, leases.Load(), inflight.Load(), serial.Load(), other.Load(), effects, distinct)
			if leases.Load() != keys || inflight.Load() != keys*(racers-1) || effects != keys || distinct != keys {
				t.Errorf("want %d leases, %d in flight, %d effects on %d keys", keys, keys*(racers-1), keys, keys)
			}
		})
	}
}

// TestCompleteTakeoverRaceUnderIsolation: an attempt whose lease has run
// out commits (Tx.Complete, its effect written in the same transaction)
// at the very moment a retry takes the key over and runs and completes it
// too, 40 times under each isolation. The store's clock is a test clock
// (the SQL is the same), moved past the first lease before the race. As
// the middleware would: a claim that fails with a serialization failure
// is sent again; a Complete that fails with one is an attempt that
// committed nothing (answered 503), and the lease is failed. Whatever the
// interleaving: exactly one attempt's effect per key, and the stored
// answer is that attempt's; the other attempt was fenced, failed, or
// replayed that answer; a key without an effect (both attempts refused)
// still holds its request and is run by the next claim; no key is lost.
func TestCompleteTakeoverRaceUnderIsolation(t *testing.T) {
	for _, level := range skewIsolationLevels {
		t.Run(level, func(t *testing.T) {
			pool := skewIsolatedPool(t, level)
			clock := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
			s := pgstore.New(pool, pgstore.Options{Now: clock.Now})
			ctx := context.Background()
			outcomes := map[string]int{}
			const rounds = 40
			for i := range rounds {
				p := idemdriver.ClaimParams{User: "u", Key: fmt.Sprintf("ct-%d", i), Fingerprint: "fp", Method: "POST", Path: "/", Owner: idemdriver.NewOwner(), Lease: time.Second, TTL: time.Hour}
				c, err := s.Claim(ctx, p)
				if err != nil || c.Lease == nil {
					t.Fatalf("first claim: %+v %v", c, err)
				}
				first := c.Lease
				tx1, err := s.Begin(ctx, first)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := tx1.(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, p.Key+"/first"); err != nil {
					t.Fatal(err)
				}
				clock.Advance(2 * time.Second) // the first lease has run out
				var firstOut, secondOut string
				var wg sync.WaitGroup
				start := make(chan struct{})
				wg.Add(2)
				go func() {
					defer wg.Done()
					<-start
					firstOut = skewSettle(ctx, s, tx1, first, "first")
				}()
				go func() {
					defer wg.Done()
					<-start
					q := p
					q.Owner = idemdriver.NewOwner()
					secondOut = skewAttempt(ctx, s, q, "second")
				}()
				close(start)
				wg.Wait()
				outcomes["first "+firstOut+", second "+secondOut]++

				var effects int
				var names []string
				rows, err := pool.Query(ctx, `SELECT name FROM effects WHERE name LIKE $1 || '/%'`, p.Key)
				if err != nil {
					t.Fatal(err)
				}
				for rows.Next() {
					var n string
					if err := rows.Scan(&n); err != nil {
						t.Fatal(err)
					}
					names = append(names, n)
				}
				rows.Close()
				effects = len(names)
				rec, err := s.Get(ctx, p.User, p.Key)
				switch {
				case err != nil:
					t.Errorf("%s: the key is lost (%v); effects %v, first %s, second %s", p.Key, err, names, firstOut, secondOut)
				case effects > 1:
					t.Errorf("%s: %d effects %v: executed twice", p.Key, effects, names)
				case effects == 1 && (rec.Response == nil || p.Key+"/"+string(rec.Response.Body) != names[0]):
					t.Errorf("%s: effect %v but stored answer %+v", p.Key, names, rec.Response)
				case effects == 0 && rec.Response != nil:
					t.Errorf("%s: no effect but a stored answer %q", p.Key, rec.Response.Body)
				case effects == 0:
					// Both attempts refused: the key holds its request, and
					// the next claim (once the lease that the retry took
					// ends) runs it, exactly once.
					clock.Advance(2 * time.Second)
					q := p
					q.Owner = idemdriver.NewOwner()
					if out := skewAttempt(ctx, s, q, "third"); out != "committed" {
						t.Errorf("%s: the attempt after two refused ones: %s, want committed", p.Key, out)
					}
				}
			}
			t.Logf("%s: %d rounds: %v", level, rounds, outcomes)
		})
	}
}

// skewAttempt claims p (sending the claim again after a serialization
// failure, as the middleware does), and if it gets the lease, writes its
// effect and settles it. It returns what happened: "replayed",
// "in flight", or skewSettle's outcome.
func skewAttempt(ctx context.Context, s *pgstore.Store, p idemdriver.ClaimParams, name string) string {
	for try := 0; ; try++ {
		c, err := s.Claim(ctx, p)
		switch {
		case skewSerializationFailure(err) && try < 20:
			continue
		case errors.Is(err, idem.ErrInFlight):
			return "in flight"
		case err != nil:
			return "claim error: " + err.Error()
		case c.Response != nil:
			return "replayed"
		}
		tx, err := s.Begin(ctx, c.Lease)
		if err != nil {
			return "begin error: " + err.Error()
		}
		if _, err := tx.(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, p.Key+"/"+name); err != nil {
			tx.Rollback(ctx)
			_ = s.Fail(ctx, c.Lease) // as the middleware: if it fails, the lease runs out
			if skewSerializationFailure(err) {
				return "serialization failure (503)"
			}
			return "write error: " + err.Error()
		}
		return skewSettle(ctx, s, tx, c.Lease, name)
	}
}

// skewSettle completes tx with the answer name and reports "committed",
// "fenced" (409), or "serialization failure (503)" after which the lease
// is failed as the middleware fails it.
func skewSettle(ctx context.Context, s *pgstore.Store, tx idem.Tx, l *idemdriver.Lease, name string) string {
	err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusCreated, Body: []byte(name)})
	switch {
	case err == nil:
		return "committed"
	case errors.Is(err, idem.ErrFenced):
		return "fenced"
	case skewSerializationFailure(err):
		if ferr := s.Fail(ctx, l); ferr != nil && !errors.Is(ferr, idem.ErrFenced) {
			return "serialization failure, then Fail: " + ferr.Error()
		}
		return "serialization failure (503)"
	default:
		return "complete error: " + err.Error()
	}
}
