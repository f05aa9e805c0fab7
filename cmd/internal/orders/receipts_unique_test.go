package orders

import (
	"context"
	"database/sql"
	"fmt"
	"io/fs"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"testing"
	"testing/fstest"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/sqlitestore"
)

// An event applied again under another key (its message id expired and
// was cleaned, and the stream delivered it again) writes no second
// receipt: the operation completes, answering the first receipt. So do
// several such deliveries at once.
func TestReceiptOfEventAppliedUnderNewKey(t *testing.T) {
	at := time.Date(2026, 5, 6, 7, 8, 9, 0, time.UTC)
	o := &Order{ID: "ord_000000000000000000000009", UserID: "alice", Status: StatusPaid, Items: []Item{{"A", 1, 700}}, Total: 700, Currency: "EUR", PaymentID: "pi", CreatedAt: at}
	ev, err := EventFor(o)
	if err != nil {
		t.Fatal(err)
	}
	for name, open := range doEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			do := func(key string) (idem.DoResult, error) {
				return idem.Do(ctx, e.store, idem.DoParams{User: "$consumer:receipts", Key: key, Operation: "orders.receipt", Input: ev.Body}, applyFunc(e.repo))
			}
			first, err := do(ev.ID)
			if err != nil {
				t.Fatal(err)
			}
			again, err := do(ev.ID + "-after-expiry")
			if err != nil || again.Replayed || string(again.Output) != string(first.Output) {
				t.Fatalf("the event under a new key = %q (replayed %v), %v; want a fresh run answering receipt %s", again.Output, again.Replayed, err, first.Output)
			}
			const racers = 6
			var wg sync.WaitGroup
			errs := make([]error, racers)
			outs := make([]string, racers)
			for i := range racers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					res, err := do(ev.ID + "-race-" + strconv.Itoa(i))
					outs[i], errs[i] = string(res.Output), err
				}()
			}
			wg.Wait()
			for i := range racers {
				if errs[i] != nil || outs[i] != string(first.Output) {
					t.Errorf("racing delivery %d = %q, %v; want receipt %s", i, outs[i], errs[i], first.Output)
				}
			}
			if got := receiptCounts(t, e.repo); len(got) != 1 || got[o.ID] != 1 {
				t.Errorf("receipts = %v, want one for %s", got, o.ID)
			}
		})
	}
}

// migrationsUpTo is fsys with only its migrations up to version last: a
// database as an older version left it.
func migrationsUpTo(t *testing.T, fsys fs.FS, last int) fs.FS {
	t.Helper()
	out := fstest.MapFS{}
	names, err := fs.Glob(fsys, "*.sql")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		v, err := strconv.Atoi(name[:4])
		if err != nil {
			t.Fatalf("migration %s: %v", name, err)
		}
		if v > last {
			continue
		}
		b, err := fs.ReadFile(fsys, name)
		if err != nil {
			t.Fatal(err)
		}
		out[name] = &fstest.MapFile{Data: b}
	}
	return out
}

// A database written before receipts were unique per event, holding
// several receipts of one event, is upgraded: the earliest stays, the
// others move to receipt_duplicates, and the index then keeps one.
func TestMigrateReceiptsUniquePerEvent(t *testing.T) {
	type env struct {
		repo  receiptRepo
		exec  func(q string, args ...any)
		ids   func(table string) []string
		param func(i int) string
	}
	envs := map[string]func(t *testing.T) env{
		"SQLite": func(t *testing.T) env {
			ctx := context.Background()
			db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "old.db")+"?_pragma=busy_timeout(5000)")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			if err := sqlitestore.ApplyMigrations(ctx, db, "orders", migrationsUpTo(t, SQLiteMigrations, 3)); err != nil {
				t.Fatal(err)
			}
			e := env{param: func(int) string { return "?" }}
			e.exec = func(q string, args ...any) {
				t.Helper()
				if _, err := db.ExecContext(ctx, q, args...); err != nil {
					t.Fatalf("%s: %v", q, err)
				}
			}
			e.ids = func(table string) []string {
				t.Helper()
				rows, err := db.QueryContext(ctx, `SELECT id FROM `+table)
				if err != nil {
					t.Fatal(err)
				}
				defer rows.Close()
				var ids []string
				for rows.Next() {
					var id string
					if err := rows.Scan(&id); err != nil {
						t.Fatal(err)
					}
					ids = append(ids, id)
				}
				if err := rows.Err(); err != nil {
					t.Fatal(err)
				}
				sort.Strings(ids)
				return ids
			}
			e.repo = sqliteRepoWith(db, func(context.Context) (sqliteExecer, error) { return nil, idem.ErrNoTx })
			return e
		},
		"PostgreSQL": func(t *testing.T) env {
			ctx := context.Background()
			pool := pgPool(t)
			if err := pgstore.ApplyMigrations(ctx, pool, "orders", migrationsUpTo(t, PostgresMigrations, 3)); err != nil {
				t.Fatal(err)
			}
			e := env{param: func(i int) string { return fmt.Sprintf("$%d", i) }}
			e.exec = func(q string, args ...any) {
				t.Helper()
				if _, err := pool.Exec(ctx, q, args...); err != nil {
					t.Fatalf("%s: %v", q, err)
				}
			}
			e.ids = func(table string) []string {
				t.Helper()
				rows, err := pool.Query(ctx, `SELECT id FROM `+table)
				if err != nil {
					t.Fatal(err)
				}
				defer rows.Close()
				var ids []string
				for rows.Next() {
					var id string
					if err := rows.Scan(&id); err != nil {
						t.Fatal(err)
					}
					ids = append(ids, id)
				}
				if err := rows.Err(); err != nil {
					t.Fatal(err)
				}
				sort.Strings(ids)
				return ids
			}
			e.repo = NewPostgresRepository(pool, nil)
			return e
		},
	}
	for name, open := range envs {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			at := time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)
			insert := fmt.Sprintf(`INSERT INTO receipts (id, order_id, event_id, user_id, total, currency, created_at) VALUES (%s, %s, %s, 'u', 5, 'EUR', %s)`,
				e.param(1), e.param(2), e.param(3), e.param(4))
			when := func(d time.Duration) any {
				if name == "SQLite" {
					return formatTime(at.Add(d))
				}
				return at.Add(d)
			}
			// Event a: three receipts, the earliest not the first by id;
			// event b: two at the same time, the lower id kept; event c:
			// one.
			e.exec(insert, "rcp_a1", "ord_a", "evt_a", when(time.Second))
			e.exec(insert, "rcp_a2", "ord_a", "evt_a", when(0))
			e.exec(insert, "rcp_a3", "ord_a", "evt_a", when(time.Hour))
			e.exec(insert, "rcp_b2", "ord_b", "evt_b", when(0))
			e.exec(insert, "rcp_b1", "ord_b", "evt_b", when(0))
			e.exec(insert, "rcp_c", "ord_c", "evt_c", when(0))

			switch name {
			case "SQLite":
				if err := MigrateSQLite(ctx, e.repo.(*SQLiteRepository).db); err != nil {
					t.Fatalf("upgrading: %v", err)
				}
			default:
				if err := MigratePostgres(ctx, e.repo.(*PostgresRepository).pool); err != nil {
					t.Fatalf("upgrading: %v", err)
				}
			}
			if got, want := fmt.Sprint(e.ids("receipts")), "[rcp_a2 rcp_b1 rcp_c]"; got != want {
				t.Errorf("receipts after the upgrade %s, want %s", got, want)
			}
			if got, want := fmt.Sprint(e.ids("receipt_duplicates")), "[rcp_a1 rcp_a3 rcp_b2]"; got != want {
				t.Errorf("receipt_duplicates after the upgrade %s, want %s", got, want)
			}
			got, added, err := e.repo.AddReceipt(ctx, Receipt{OrderID: "ord_a", EventID: "evt_a", UserID: "u", Total: 5, Currency: "EUR"})
			if err != nil || added || got.ID != "rcp_a2" {
				t.Errorf("AddReceipt of event a after the upgrade = %+v, %v, %v; want rcp_a2 found", got, added, err)
			}
		})
	}
}
