package sqlitestore_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/sqlitestore"
)

// The handler's transaction (Tx.SQL, FromContext) refuses Commit and
// Rollback (idem.ErrTxOwned) before its first write and after it, and
// changes nothing; its statement methods, and its savepoints, work as
// *sql.Tx's do. What it kept commits with the completion, and nothing
// before it.
func TestHandlerTxCannotEndTx(t *testing.T) {
	s, _ := setup(t, sqlitestore.Options{})
	ctx := context.Background()
	c, err := s.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: "owned", Fingerprint: "fp", Method: "POST", Path: "/"})
	if err != nil || c.Lease == nil {
		t.Fatalf("Claim = %+v, %v", c, err)
	}
	tx, err := s.Begin(ctx, c.Lease)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	h := tx.(*sqlitestore.Tx).SQL()
	refused := func(when string) {
		t.Helper()
		if err := h.Commit(); !errors.Is(err, idem.ErrTxOwned) {
			t.Fatalf("Commit %s = %v, want idem.ErrTxOwned", when, err)
		}
		if err := h.Rollback(); !errors.Is(err, idem.ErrTxOwned) {
			t.Fatalf("Rollback %s = %v, want idem.ErrTxOwned", when, err)
		}
	}
	const insert = `INSERT INTO storetest_effects (name) VALUES (?)`
	refused("before any statement")
	if _, err := h.ExecContext(ctx, insert, "exec-context"); err != nil {
		t.Fatal(err)
	}
	refused("after a write")
	if _, err := h.Exec(insert, "exec"); err != nil {
		t.Fatal(err)
	}
	stmt, err := h.PrepareContext(ctx, insert)
	if err != nil {
		t.Fatal(err)
	}
	defer stmt.Close()
	if _, err := stmt.ExecContext(ctx, "prepare-context"); err != nil {
		t.Fatal(err)
	}
	stmt2, err := h.Prepare(insert)
	if err != nil {
		t.Fatal(err)
	}
	defer stmt2.Close()
	if _, err := stmt2.Exec("prepare"); err != nil {
		t.Fatal(err)
	}
	dbStmt, err := s.DB().PrepareContext(ctx, insert)
	if err != nil {
		t.Fatal(err)
	}
	defer dbStmt.Close()
	txStmt := h.StmtContext(ctx, dbStmt)
	defer txStmt.Close()
	if _, err := txStmt.ExecContext(ctx, "stmt-context"); err != nil {
		t.Fatal(err)
	}
	txStmt2 := h.Stmt(dbStmt)
	defer txStmt2.Close()
	if _, err := txStmt2.Exec("stmt"); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{`SAVEPOINT sp`, `INSERT INTO storetest_effects (name) VALUES ('undone')`, `ROLLBACK TO sp`, `RELEASE sp`} {
		if _, err := h.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	refused("after a savepoint")
	var n int
	if err := h.QueryRowContext(ctx, `SELECT count(*) FROM storetest_effects`).Scan(&n); err != nil || n != 6 {
		t.Fatalf("QueryRowContext in the transaction: %d rows, %v; want 6", n, err)
	}
	if err := h.QueryRow(`SELECT count(*) FROM storetest_effects WHERE name = 'undone'`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("QueryRow in the transaction: %d rows undone, %v; want 0", n, err)
	}
	for _, query := range []func() (*sql.Rows, error){
		func() (*sql.Rows, error) { return h.QueryContext(ctx, `SELECT name FROM storetest_effects`) },
		func() (*sql.Rows, error) { return h.Query(`SELECT name FROM storetest_effects`) },
	} {
		if n, err := countRows(query); err != nil || n != 6 {
			t.Fatalf("Query in the transaction: %d rows, %v; want 6", n, err)
		}
	}
	if got := mustCount(t, s, "exec-context"); got != 0 {
		t.Fatalf("the handler's write is visible before Complete (%d rows): its transaction ended", got)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{Status: 201}); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	for _, name := range []string{"exec-context", "exec", "prepare-context", "prepare", "stmt-context", "stmt"} {
		if got := mustCount(t, s, name); got != 1 {
			t.Errorf("%s: %d rows after Complete, want 1", name, got)
		}
	}
	if got := mustCount(t, s, "undone"); got != 0 {
		t.Errorf("undone: %d rows after Complete, want 0", got)
	}
	rec, err := s.Get(ctx, "u", "owned")
	if err != nil || rec.Response == nil || rec.Response.Status != 201 {
		t.Fatalf("Get = %+v, %v; want the stored 201", rec, err)
	}
}

// countRows runs query and counts its rows.
func countRows(query func() (*sql.Rows, error)) (int, error) {
	rows, err := query()
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		n++
	}
	return n, rows.Err()
}
