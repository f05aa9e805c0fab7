package orders

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/idem-go/idem"
	_ "modernc.org/sqlite"
)

// openRepo opens a bare SQLite database with the orders schema, and a
// repository that writes in its own transactions. The database does not
// wait on the disk, for cases that write many orders.
func openRepo(t testing.TB) (*SQLiteRepository, *sql.DB) {
	t.Helper()
	db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "repo.db")+"?_pragma=busy_timeout(5000)&_pragma=journal_mode(WAL)&_pragma=synchronous(OFF)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if err := MigrateSQLite(context.Background(), db); err != nil {
		t.Fatal(err)
	}
	noTx := func(context.Context) (sqliteExecer, error) { return nil, idem.ErrNoTx }
	return sqliteRepoWith(db, noTx), db
}

// sqliteRepoWith is a repository on db whose request transaction is
// txFrom's, which a test makes of a *sql.Tx of its own (outside a
// request, sqlitestore.FromContext has none to give).
func sqliteRepoWith(db *sql.DB, txFrom func(context.Context) (sqliteExecer, error)) *SQLiteRepository {
	r := NewSQLiteRepository(db, nil)
	r.txFrom = txFrom
	return r
}

func TestSQLiteRepositoryUsesRequestTx(t *testing.T) {
	ctx := context.Background()
	_, db := openRepo(t)
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	repo := sqliteRepoWith(db, func(context.Context) (sqliteExecer, error) { return tx, nil })
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

	failing := sqliteRepoWith(db, func(context.Context) (sqliteExecer, error) { return nil, errors.New("store down") })
	if err := failing.Create(ctx, o); err == nil {
		t.Error("Create succeeded although the request transaction failed")
	}
}
