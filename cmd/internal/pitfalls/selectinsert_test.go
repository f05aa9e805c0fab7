package pitfalls

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
)

// Trap (c): a SELECT before the INSERT. "Is the key there? No: insert it
// and run" leaves a gap between the check and the write in which every
// concurrent duplicate makes the same check and gets the same answer.
// Neither a transaction (READ COMMITTED, PostgreSQL's default) nor SELECT
// … FOR UPDATE closes it: there is no row yet to see or to lock.

// racers is how many duplicates of one request race; each holds a
// connection of the test's pool at the barrier.
const racers = pgtest.DefaultMaxConns

// TestSelectBeforeInsert: duplicates of one request that reach a
// hand-rolled check-then-insert together (a barrier holds each between its
// SELECT and its INSERT until all have checked) all run, in each of its
// forms; left to the scheduler, without the barrier, they still run more
// than once within a bounded number of tries. pgstore's Claim, whose
// INSERT … ON CONFLICT DO NOTHING on the unique key is the check, gives
// exactly one of them the lease every time.
func TestSelectBeforeInsert(t *testing.T) {
	pool := pgtest.Pool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE naive_keys (user_id text NOT NULL, key text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	naive := []struct {
		name  string
		claim func(ctx context.Context, key string, between func()) (bool, error)
	}{
		{"naive/SELECT then INSERT", func(ctx context.Context, key string, between func()) (bool, error) {
			return checkThenInsert(ctx, pool, key, "SELECT count(*) FROM naive_keys WHERE user_id = 'alice' AND key = $1", between)
		}},
		{"naive/in a transaction", func(ctx context.Context, key string, between func()) (bool, error) {
			return inTx(ctx, pool, func(tx pgx.Tx) (bool, error) {
				return checkThenInsert(ctx, tx, key, "SELECT count(*) FROM naive_keys WHERE user_id = 'alice' AND key = $1", between)
			})
		}},
		{"naive/SELECT FOR UPDATE in a transaction", func(ctx context.Context, key string, between func()) (bool, error) {
			return inTx(ctx, pool, func(tx pgx.Tx) (bool, error) {
				return checkThenInsert(ctx, tx, key, "SELECT count(*) FROM (SELECT 1 FROM naive_keys WHERE user_id = 'alice' AND key = $1 FOR UPDATE) s", between)
			})
		}},
	}
	for _, n := range naive {
		t.Run(n.name, func(t *testing.T) {
			for round := range 3 {
				key := fmt.Sprintf("%s/%d", n.name, round)
				b := newBarrier(racers)
				runs := race(t, racers, func() (bool, error) {
					return n.claim(ctx, key, func() {
						if !b.wait() {
							t.Error("the racers did not all reach the barrier")
						}
					})
				})
				if runs != racers || countKeys(t, pool, key) != racers {
					t.Fatalf("round %d: %d of %d duplicates ran, %d rows; want all of them", round, runs, racers, countKeys(t, pool, key))
				}
			}
		})
	}

	t.Run("naive/SELECT then INSERT, no barrier", func(t *testing.T) {
		// No hook: the duplicates start together and the scheduler
		// decides. A round where more than one runs comes within a few.
		const maxRounds = 200
		for round := range maxRounds {
			key := fmt.Sprintf("free/%d", round)
			start := make(chan struct{})
			runs := race(t, racers, func() (bool, error) {
				<-start
				return checkThenInsert(ctx, pool, key, "SELECT count(*) FROM naive_keys WHERE user_id = 'alice' AND key = $1", nil)
			}, func() { close(start) })
			if runs > 1 {
				t.Logf("round %d: %d of %d duplicates ran", round+1, runs, racers)
				return
			}
		}
		t.Fatalf("in %d rounds the check-then-insert never ran a request twice", maxRounds)
	})

	t.Run("pgstore Claim", func(t *testing.T) {
		if err := pgstore.Migrate(ctx, pool); err != nil {
			t.Fatal(err)
		}
		store := pgstore.New(pool, pgstore.Options{})
		for round := range 20 {
			key := fmt.Sprintf("claim/%d", round)
			b := newBarrier(racers)
			var inFlight atomic.Int64
			runs := race(t, racers, func() (bool, error) {
				if !b.wait() {
					return false, errors.New("the racers did not all reach the barrier")
				}
				c, err := store.Claim(ctx, idemdriver.ClaimParams{User: "alice", Key: key, Fingerprint: "fp", Owner: idemdriver.NewOwner()})
				if errors.Is(err, idem.ErrInFlight) {
					inFlight.Add(1)
					return false, nil
				}
				return err == nil && c.Lease != nil, err
			})
			var rows int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE user_id = 'alice' AND key = $1`, key).Scan(&rows); err != nil {
				t.Fatal(err)
			}
			if runs != 1 || inFlight.Load() != racers-1 || rows != 1 {
				t.Fatalf("round %d: %d leases, %d in flight, %d rows; want 1, %d, 1", round, runs, inFlight.Load(), rows, racers-1)
			}
		}
	})
}

// queryer is a pool or a transaction.
type queryer interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// checkThenInsert is the hand-rolled claim: count the key's rows with
// check, and if there are none, call between (the gap), insert the key
// and report that the request is to run.
func checkThenInsert(ctx context.Context, q queryer, key, check string, between func()) (bool, error) {
	var n int
	if err := q.QueryRow(ctx, check, key).Scan(&n); err != nil {
		return false, err
	}
	if between != nil {
		between()
	}
	if n > 0 {
		return false, nil
	}
	_, err := q.Exec(ctx, `INSERT INTO naive_keys (user_id, key) VALUES ('alice', $1)`, key)
	return err == nil, err
}

// inTx runs fn in a transaction (READ COMMITTED) and commits.
func inTx(ctx context.Context, pool *pgxpool.Pool, fn func(pgx.Tx) (bool, error)) (bool, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer tx.Rollback(ctx)
	ok, err := fn(tx)
	if err != nil {
		return false, err
	}
	return ok, tx.Commit(ctx)
}

// race runs claim in n goroutines at once and counts those told to run.
// started, if given, is called once all goroutines are started.
func race(t *testing.T, n int, claim func() (bool, error), started ...func()) int {
	t.Helper()
	var (
		wg   sync.WaitGroup
		runs atomic.Int64
	)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ok, err := claim()
			if err != nil {
				t.Error(err)
			}
			if ok {
				runs.Add(1)
			}
		}()
	}
	for _, f := range started {
		f()
	}
	wg.Wait()
	return int(runs.Load())
}

func countKeys(t *testing.T, pool *pgxpool.Pool, key string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM naive_keys WHERE key = $1`, key).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
