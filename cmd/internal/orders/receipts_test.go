package orders

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// receiptRepo is a repository with the receipts' audit methods.
type receiptRepo interface {
	ReceiptWriter
	AllReceipts(ctx context.Context, fn func(Receipt) error) error
}

var (
	_ receiptRepo = (*SQLiteRepository)(nil)
	_ receiptRepo = (*PostgresRepository)(nil)
)

// receiptEnv is a repository on a fresh database, and a way to run a
// function in a transaction that the repository writes in, as an
// idempotent operation's: commit or roll back.
type receiptEnv struct {
	repo receiptRepo
	inTx func(t *testing.T, commit bool, fn func(repo receiptRepo))
}

func receiptEnvs() map[string]func(t *testing.T) receiptEnv {
	return map[string]func(t *testing.T) receiptEnv{
		"SQLite": func(t *testing.T) receiptEnv {
			repo, db := openRepo(t)
			return receiptEnv{repo: repo, inTx: func(t *testing.T, commit bool, fn func(receiptRepo)) {
				tx, err := db.BeginTx(context.Background(), nil)
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback()
				fn(sqliteRepoWith(db, func(context.Context) (sqliteExecer, error) { return tx, nil }))
				if commit {
					if err := tx.Commit(); err != nil {
						t.Fatal(err)
					}
				}
			}}
		},
		"PostgreSQL": func(t *testing.T) receiptEnv {
			repo, pool := pgOpenRepo(t)
			return receiptEnv{repo: repo, inTx: func(t *testing.T, commit bool, fn func(receiptRepo)) {
				ctx := context.Background()
				tx, err := pool.Begin(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(ctx)
				fn(NewPostgresRepository(pool, func(context.Context) (pgx.Tx, error) { return tx, nil }))
				if commit {
					if err := tx.Commit(ctx); err != nil {
						t.Fatal(err)
					}
				}
			}}
		},
	}
}

// sameReceipt reports whether a and b are equal, their times compared
// with Equal.
func sameReceipt(a, b Receipt) bool {
	at, bt := a.CreatedAt, b.CreatedAt
	a.CreatedAt, b.CreatedAt = time.Time{}, time.Time{}
	return a == b && at.Equal(bt)
}

func receiptCounts(t *testing.T, repo receiptRepo) map[string]int {
	t.Helper()
	counts := make(map[string]int)
	if err := repo.AllReceipts(context.Background(), func(r Receipt) error { counts[r.OrderID]++; return nil }); err != nil {
		t.Fatalf("AllReceipts: %v", err)
	}
	return counts
}

// A receipt is written in the operation's transaction: it commits with it
// or not at all.
func TestReceiptInRequestTx(t *testing.T) {
	for name, open := range receiptEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			r := Receipt{OrderID: "ord_a", EventID: EventID("ord_a"), UserID: "alice", Total: 1299, Currency: "EUR"}
			e.inTx(t, false, func(repo receiptRepo) {
				if _, _, err := repo.AddReceipt(ctx, r); err != nil {
					t.Fatal(err)
				}
			})
			if got := receiptCounts(t, e.repo); len(got) != 0 {
				t.Errorf("receipts after a rolled-back transaction = %v, want none", got)
			}
			e.inTx(t, true, func(repo receiptRepo) {
				if _, _, err := repo.AddReceipt(ctx, r); err != nil {
					t.Fatal(err)
				}
			})
			if got := receiptCounts(t, e.repo); len(got) != 1 || got["ord_a"] != 1 {
				t.Errorf("receipts after a commit = %v, want ord_a once", got)
			}
		})
	}
}

// Receipts read back as written; a second receipt of one event is not
// added (the first is returned), one naming another order is refused, and
// AllReceipts pages through all.
func TestReceiptsAudit(t *testing.T) {
	for name, open := range receiptEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			at := time.Date(2026, 1, 2, 3, 4, 5, 678901000, time.UTC)
			first := Receipt{ID: "rcp_1", OrderID: "ord_x", EventID: "evt_x", UserID: "bob", Total: 5, Currency: "JPY", CreatedAt: at}
			if got, added, err := e.repo.AddReceipt(ctx, first); err != nil || !added || !sameReceipt(got, first) {
				t.Fatalf("AddReceipt = %+v, %v, %v; want %+v added", got, added, err, first)
			}
			if got, added, err := e.repo.AddReceipt(ctx, Receipt{OrderID: "ord_x", EventID: "evt_x", UserID: "bob", Total: 5, Currency: "JPY"}); err != nil || added || !sameReceipt(got, first) {
				t.Errorf("a second receipt of one event: AddReceipt = %+v, %v, %v; want %+v found, not added", got, added, err, first)
			}
			if _, _, err := e.repo.AddReceipt(ctx, Receipt{OrderID: "ord_y", EventID: "evt_x", UserID: "bob", Total: 5, Currency: "JPY"}); err == nil {
				t.Error("AddReceipt took event evt_x's receipt for another order")
			}
			if _, _, err := e.repo.AddReceipt(ctx, Receipt{OrderID: "ord_x", UserID: "bob"}); err == nil {
				t.Error("AddReceipt took a receipt without an event id")
			}
			n := 2*auditPageSize + 1
			e.inTx(t, true, func(repo receiptRepo) {
				for i := range n {
					id := fmt.Sprintf("ord_%04d", i)
					if _, _, err := repo.AddReceipt(ctx, Receipt{OrderID: id, EventID: EventID(id), UserID: "u", Total: int64(i), Currency: "EUR"}); err != nil {
						t.Fatal(err)
					}
				}
			})
			counts := receiptCounts(t, e.repo)
			if len(counts) != n+1 || counts["ord_x"] != 1 || counts["ord_0000"] != 1 {
				t.Errorf("receipt counts: %d orders, ord_x %d, ord_0000 %d; want %d, 1, 1", len(counts), counts["ord_x"], counts["ord_0000"], n+1)
			}
			var (
				all  []Receipt
				ids  = make(map[string]bool)
				prev string
			)
			err := e.repo.AllReceipts(ctx, func(r Receipt) error {
				key := r.OrderID + "\x00" + r.ID
				if key <= prev {
					return fmt.Errorf("receipt %s/%s after %q: not in order", r.OrderID, r.ID, prev)
				}
				prev = key
				if ids[r.ID] || !strings.HasPrefix(r.ID, "rcp_") {
					return fmt.Errorf("receipt id %q repeated or malformed", r.ID)
				}
				ids[r.ID] = true
				all = append(all, r)
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if len(all) != n+1 {
				t.Fatalf("AllReceipts gave %d receipts, want %d", len(all), n+1)
			}
			var got Receipt
			for _, r := range all {
				if r.ID == "rcp_1" {
					got = r
				}
			}
			if !sameReceipt(got, first) {
				t.Errorf("receipt read back as %+v, want %+v", got, first)
			}
			stop := errors.New("stop")
			calls := 0
			if err := e.repo.AllReceipts(ctx, func(Receipt) error { calls++; return stop }); !errors.Is(err, stop) || calls != 1 {
				t.Errorf("AllReceipts after fn's error: %v after %d calls, want it returned after 1", err, calls)
			}
		})
	}
}

// ApplyCreated writes the receipt of the order whose JSON it is given, and
// refuses anything else with ErrBadEvent, writing nothing.
func TestApplyCreated(t *testing.T) {
	o := &Order{
		ID: "ord_0123456789abcdef01234567", UserID: "alice", Status: StatusPaid,
		Items: []Item{{SKU: "SKU-1", Quantity: 2, UnitPrice: 1299}}, Total: 2598, Currency: "EUR",
		PaymentID: "pi_1", CreatedAt: time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC),
	}
	body, err := OrderJSON(o)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := DecodeCreated(body); err != nil || got.ID != o.ID || got.UserID != o.UserID || !got.CreatedAt.Equal(o.CreatedAt) || len(got.Items) != 1 || got.Items[0] != o.Items[0] {
		t.Errorf("DecodeCreated = %+v, %v; want %+v", got, err, *o)
	}
	good := strings.TrimSuffix(string(body), "\n")
	bad := map[string]string{
		"empty":            ``,
		"not JSON":         `{`,
		"array":            `[]`,
		"null":             `null`,
		"two values":       good + good,
		"unknown member":   strings.Replace(good, `"id":`, `"extra":1,"id":`, 1),
		"repeated member":  strings.Replace(good, `"id":`, `"total":1,"id":`, 1),
		"case twin":        strings.Replace(good, `"id":`, `"ID":"ord_x","id":`, 1),
		"no id":            strings.Replace(good, `"id":"ord_0123456789abcdef01234567",`, ``, 1),
		"no user":          strings.Replace(good, `"user_id":"alice"`, `"user_id":""`, 1),
		"not paid":         strings.Replace(good, `"status":"paid"`, `"status":"pending"`, 1),
		"negative total":   strings.Replace(good, `"total":2598`, `"total":-1`, 1),
		"bad currency":     strings.Replace(good, `"currency":"EUR"`, `"currency":"eur"`, 1),
		"no created_at":    strings.Replace(good, `,"created_at":"2026-01-02T03:04:05.000006Z"`, ``, 1),
		"total a string":   strings.Replace(good, `"total":2598`, `"total":"2598"`, 1),
		"invalid UTF-8":    strings.Replace(good, `SKU-1`, "SKU-\xff", 1),
		"bad created_at":   strings.Replace(good, `2026-01-02T03:04:05.000006Z`, `yesterday`, 1),
		"user with a ctrl": strings.Replace(good, `"user_id":"alice"`, `"user_id":"al\u0007ice"`, 1),
	}
	for name, open := range receiptEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			for what, b := range bad {
				if b == good {
					t.Fatalf("%s: the case does not change the body", what)
				}
				if _, err := DecodeCreated([]byte(b)); !errors.Is(err, ErrBadEvent) {
					t.Errorf("%s: DecodeCreated(%q) = %v, want ErrBadEvent", what, b, err)
				}
				if _, err := ApplyCreated(ctx, e.repo, []byte(b)); !errors.Is(err, ErrBadEvent) {
					t.Errorf("%s: ApplyCreated(%q) = %v, want ErrBadEvent", what, b, err)
				}
			}
			if got := receiptCounts(t, e.repo); len(got) != 0 {
				t.Fatalf("receipts after bad events = %v, want none", got)
			}
			var r Receipt
			e.inTx(t, true, func(repo receiptRepo) {
				if r, err = ApplyCreated(ctx, repo, body); err != nil {
					t.Fatalf("ApplyCreated: %v", err)
				}
			})
			want := Receipt{ID: r.ID, OrderID: o.ID, EventID: "evt_0123456789abcdef01234567", UserID: "alice", Total: 2598, Currency: "EUR", CreatedAt: r.CreatedAt}
			if !sameReceipt(r, want) || r.CreatedAt.IsZero() {
				t.Errorf("receipt = %+v, want %+v", r, want)
			}
			var stored []Receipt
			if err := e.repo.AllReceipts(ctx, func(r Receipt) error { stored = append(stored, r); return nil }); err != nil {
				t.Fatal(err)
			}
			if len(stored) != 1 || !sameReceipt(stored[0], r) {
				t.Errorf("stored receipts = %+v, want [%+v]", stored, r)
			}
		})
	}
}
