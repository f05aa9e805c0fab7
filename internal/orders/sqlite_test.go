package orders

import (
	"context"
	"database/sql"
	"errors"
	"io/fs"
	"path/filepath"
	"testing"
	"time"

	"github.com/idem-go/idem"
	_ "modernc.org/sqlite"
)

// openRepo opens a bare SQLite database with the orders schema, and a
// repository that writes in its own transactions.
func openRepo(t *testing.T) (*SQLiteRepository, *sql.DB) {
	t.Helper()
	db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "repo.db")+"?_pragma=busy_timeout(5000)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	schema, err := readMigration("0001_create_orders.sql")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(schema); err != nil {
		t.Fatal(err)
	}
	noTx := func(context.Context) (*sql.Tx, error) { return nil, idem.ErrNoTx }
	return NewSQLiteRepository(db, noTx), db
}

func readMigration(name string) (string, error) {
	b, err := fs.ReadFile(SQLiteMigrations, name)
	return string(b), err
}

func TestSQLiteRepository(t *testing.T) {
	ctx := context.Background()
	repo, _ := openRepo(t)
	if err := repo.Ping(ctx); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	at := time.Date(2025, 1, 2, 3, 4, 5, 678901000, time.UTC)
	o := &Order{
		ID: "ord_1", UserID: "alice", Status: StatusPaid,
		Items: []Item{{SKU: "A", Quantity: 2, UnitPrice: 5}, {SKU: "B", Quantity: 1, UnitPrice: 7}},
		Total: 17, Currency: "EUR", PaymentID: "pi_1", CreatedAt: at,
		IdempotencyKey: "k", KeyCreatedAt: at.Add(-time.Second),
	}
	if err := repo.Create(ctx, o); err != nil {
		t.Fatalf("Create: %v", err)
	}
	got, err := repo.Get(ctx, "alice", "ord_1")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if got.ID != o.ID || got.UserID != o.UserID || got.Total != o.Total || len(got.Items) != 2 || got.Items[1] != o.Items[1] ||
		!got.CreatedAt.Equal(at) || got.IdempotencyKey != "k" || !got.KeyCreatedAt.Equal(o.KeyCreatedAt) || got.PaymentID != "pi_1" {
		t.Errorf("Get = %+v, want %+v", got, o)
	}
	if _, err := repo.Get(ctx, "bob", "ord_1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get of another user's order: %v, want ErrNotFound", err)
	}

	// The same id, or the same (user, key, key creation), is refused.
	dup := *o
	dup.IdempotencyKey = "other"
	if err := repo.Create(ctx, &dup); !errors.Is(err, ErrExists) {
		t.Errorf("Create with a taken id: %v, want ErrExists", err)
	}
	dup = *o
	dup.ID = "ord_2"
	if err := repo.Create(ctx, &dup); !errors.Is(err, ErrExists) {
		t.Errorf("Create with a taken key: %v, want ErrExists", err)
	}
	// The same key after it expired (a new record) is another operation.
	dup.KeyCreatedAt = at.Add(time.Hour)
	if err := repo.Create(ctx, &dup); err != nil {
		t.Errorf("Create with a new generation of the key: %v", err)
	}
	// Orders without a key never collide on it.
	for _, id := range []string{"ord_3", "ord_4"} {
		if err := repo.Create(ctx, &Order{ID: id, UserID: "alice", Status: StatusPaid, Items: o.Items, Total: 17, Currency: "EUR", PaymentID: "pi_" + id, CreatedAt: at}); err != nil {
			t.Errorf("Create %s without a key: %v", id, err)
		}
	}

	list, more, err := repo.List(ctx, "alice", 10, "")
	if err != nil || more || len(list) != 4 {
		t.Fatalf("List = %d orders, %v, %v; want 4", len(list), more, err)
	}
	if _, _, err := repo.List(ctx, "alice", 10, "ord_nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("List after an unknown order: %v, want ErrNotFound", err)
	}
	if _, _, err := repo.List(ctx, "bob", 10, "ord_1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("List after another user's order: %v, want ErrNotFound", err)
	}
}

func TestSQLiteRepositoryUsesRequestTx(t *testing.T) {
	ctx := context.Background()
	_, db := openRepo(t)
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	repo := NewSQLiteRepository(db, func(context.Context) (*sql.Tx, error) { return tx, nil })
	o := &Order{ID: "ord_tx", UserID: "alice", Status: StatusPaid, Items: []Item{{"A", 1, 1}}, Total: 1, Currency: "EUR", PaymentID: "pi", CreatedAt: time.Now()}
	if err := repo.Create(ctx, o); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if _, err := repo.Get(ctx, "alice", "ord_tx"); !errors.Is(err, ErrNotFound) {
		t.Errorf("order outlived the rolled-back request transaction: %v", err)
	}

	failing := NewSQLiteRepository(db, func(context.Context) (*sql.Tx, error) { return nil, errors.New("store down") })
	if err := failing.Create(ctx, o); err == nil {
		t.Error("Create succeeded although the request transaction failed")
	}
}
