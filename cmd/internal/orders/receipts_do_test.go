package orders

import (
	"context"
	"errors"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/sqlitestore"
)

// doEnv is an idempotency store and a repository that writes in its
// operations' transactions, on one fresh database.
type doEnv struct {
	store idem.Store
	repo  receiptRepo
}

func doEnvs() map[string]func(t *testing.T) doEnv {
	return map[string]func(t *testing.T) doEnv{
		"SQLite": func(t *testing.T) doEnv {
			ctx := context.Background()
			st, err := sqlitestore.Open(ctx, filepath.Join(t.TempDir(), "orders.db"), sqlitestore.Options{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			if err := MigrateSQLite(ctx, st.DB()); err != nil {
				t.Fatal(err)
			}
			return doEnv{st, NewSQLiteRepository(st.DB(), sqlitestore.FromContext)}
		},
		"PostgreSQL": func(t *testing.T) doEnv {
			ctx := context.Background()
			pool := pgPool(t)
			if err := pgstore.Migrate(ctx, pool); err != nil {
				t.Fatal(err)
			}
			if err := MigratePostgres(ctx, pool); err != nil {
				t.Fatal(err)
			}
			return doEnv{pgstore.New(pool, pgstore.Options{}), NewPostgresRepository(pool, pgstore.FromContext)}
		},
	}
}

// applyFunc is the receipts consumer's operation: ApplyCreated, its
// output the receipt's id.
func applyFunc(repo ReceiptWriter) idem.DoFunc {
	return func(ctx context.Context, in []byte) ([]byte, error) {
		r, err := ApplyCreated(ctx, repo, in)
		if err != nil {
			return nil, err
		}
		return []byte(r.ID), nil
	}
}

// A receipt applied through idem.Do commits with the key: repeats, racing
// ones included, replay it and write no other; a function that fails
// after writing it leaves none, and the retry writes one.
func TestReceiptThroughDo(t *testing.T) {
	at := time.Date(2026, 5, 6, 7, 8, 9, 0, time.UTC)
	event := func(id string) (string, []byte) {
		o := &Order{ID: id, UserID: "alice", Status: StatusPaid, Items: []Item{{"A", 1, 700}}, Total: 700, Currency: "EUR", PaymentID: "pi", CreatedAt: at}
		ev, err := EventFor(o)
		if err != nil {
			t.Fatal(err)
		}
		return ev.ID, ev.Body
	}
	for name, open := range doEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			params := func(key string, body []byte) idem.DoParams {
				return idem.DoParams{User: "$consumer:receipts", Key: key, Operation: "orders.receipt", Input: body, InFlightWait: 10 * time.Second}
			}

			// Racing deliveries of one message: one receipt.
			key, body := event("ord_000000000000000000000001")
			const racers = 8
			outs := make([]idem.DoResult, racers)
			errs := make([]error, racers)
			var wg sync.WaitGroup
			for i := range racers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					outs[i], errs[i] = idem.Do(ctx, e.store, params(key, body), applyFunc(e.repo))
				}()
			}
			wg.Wait()
			fresh := 0
			for i := range racers {
				if errs[i] != nil {
					t.Fatalf("Do #%d: %v", i, errs[i])
				}
				if !outs[i].Replayed {
					fresh++
				}
				if string(outs[i].Output) != string(outs[0].Output) {
					t.Errorf("Do #%d output %q, want %q (one receipt)", i, outs[i].Output, outs[0].Output)
				}
			}
			if fresh != 1 {
				t.Errorf("%d deliveries ran the function, want 1", fresh)
			}
			if got := receiptCounts(t, e.repo); len(got) != 1 || got["ord_000000000000000000000001"] != 1 {
				t.Fatalf("receipts = %v, want one for the order", got)
			}

			// Written, then the function fails: rolled back; the retry
			// writes the one receipt.
			key2, body2 := event("ord_000000000000000000000002")
			boom := errors.New("boom after the write")
			_, err := idem.Do(ctx, e.store, params(key2, body2), func(ctx context.Context, in []byte) ([]byte, error) {
				if _, err := ApplyCreated(ctx, e.repo, in); err != nil {
					return nil, err
				}
				return nil, boom
			})
			if !errors.Is(err, boom) {
				t.Fatalf("Do with a failing function = %v, want its error", err)
			}
			if got := receiptCounts(t, e.repo); got["ord_000000000000000000000002"] != 0 {
				t.Fatalf("receipts after the failed attempt = %v, want none for its order", got)
			}
			res, err := idem.Do(ctx, e.store, params(key2, body2), applyFunc(e.repo))
			if err != nil || res.Replayed {
				t.Fatalf("retry = %+v, %v; want a fresh run", res, err)
			}
			if got := receiptCounts(t, e.repo); got["ord_000000000000000000000002"] != 1 {
				t.Fatalf("receipts after the retry = %v, want one for its order", got)
			}

			// A bad body: ErrBadEvent through Do, nothing written.
			if _, err := idem.Do(ctx, e.store, params("evt_bad", []byte(`{"id":1}`)), applyFunc(e.repo)); !errors.Is(err, ErrBadEvent) {
				t.Errorf("Do of a bad body = %v, want ErrBadEvent", err)
			}
			if got := receiptCounts(t, e.repo); len(got) != 2 {
				t.Errorf("receipts = %v, want the two orders'", got)
			}
		})
	}
}
