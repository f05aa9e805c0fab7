package ordersapp

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/testwait"
)

// oneUserCheck makes PostgreSQL record, in cross_user.statements, every
// statement that writes rows of more than one user in a checked table:
// statement-level triggers read the rows a statement inserted, updated or
// deleted (its transition tables) and count the distinct values of the
// table's distribution column (the trigger's argument).
const oneUserCheck = `
CREATE SCHEMA cross_user;
CREATE TABLE cross_user.statements (tbl text, op text, users bigint, query text);
CREATE FUNCTION cross_user.check() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE n bigint;
BEGIN
	IF TG_OP = 'DELETE' THEN
		EXECUTE format('SELECT count(DISTINCT %I) FROM old_rows', TG_ARGV[0]) INTO n;
	ELSE
		EXECUTE format('SELECT count(DISTINCT %I) FROM new_rows', TG_ARGV[0]) INTO n;
	END IF;
	IF n > 1 THEN
		INSERT INTO cross_user.statements VALUES (TG_TABLE_NAME, TG_OP, n, current_query());
	END IF;
	RETURN NULL;
END $$;
`

// checkWrites adds oneUserCheck's triggers to table for ops (INSERT,
// UPDATE, DELETE), on its column col.
func checkWrites(table, col string, ops ...string) []string {
	var out []string
	for _, op := range ops {
		ref := "NEW TABLE AS new_rows"
		switch op {
		case "DELETE":
			ref = "OLD TABLE AS old_rows"
		case "UPDATE":
			ref = "OLD TABLE AS old_rows NEW TABLE AS new_rows"
		}
		out = append(out, fmt.Sprintf(`CREATE TRIGGER cross_user_%s_%s AFTER %s ON %s REFERENCING %s
			FOR EACH STATEMENT EXECUTE FUNCTION cross_user.check(%s)`, table, strings.ToLower(op), op, table, ref, col))
	}
	return out
}

// TestRequestWritesStayWithinOneUser runs the request path of two
// instances on one PostgreSQL database (creates from several users, each
// key sent several times at once, to different instances, so that some
// wait, some replay; the consumer writing each order's receipt) with
// triggers that record every statement writing rows of two users in the
// tables distributed by user (docs/SCALING.md, "Beyond one primary"): none
// may. The outbox is checked for its inserts, by ordering key: the relay's
// marks and sweeps, the cleaner's deletes and the backfill's updates are
// batches over many users by design (SCALING.md names them), and the
// keys here do not expire. The check itself is shown to record a write
// that spans users.
func TestRequestWritesStayWithinOneUser(t *testing.T) {
	db := pgtest.Database(t)
	if code, out, errs := run(t, nil, "migrate", "--database-url", db, "--data-dir", t.TempDir()); code != 0 {
		t.Fatalf("orders migrate = exit %d:\n%s%s", code, out, errs)
	}
	stmts := []string{oneUserCheck}
	for _, table := range []string{"orders", "receipts", "receipt_duplicates", "idempotency_keys"} {
		stmts = append(stmts, checkWrites(table, "user_id", "INSERT", "UPDATE", "DELETE")...)
	}
	stmts = append(stmts, checkWrites("idem_outbox", "ordering_key", "INSERT")...)
	pgExec(t, db, stmts...)

	dir := t.TempDir()
	natsURL := testNATS(t)
	var insts []*inProcess
	for range 2 {
		insts = append(insts, startInProcess(t, &Config{DatabaseURL: db, DataDir: dir, JWTSecret: testSecret, PaymentsKey: "sk_test_local",
			NATSURL: natsURL, KeyTTL: 24 * time.Hour, KeyLease: 30 * time.Second, RequireKey: true, Consume: true}))
	}
	const users, keys, copies = 4, 24, 3
	hc := retrying()
	var (
		mu     sync.Mutex
		status = map[int]int{}
		wg     sync.WaitGroup
	)
	for k := range keys {
		for c := range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s, err := post(hc, insts[(k+c)%len(insts)].base, fmt.Sprintf("shard-user-%d", k%users), fmt.Sprintf("shard-key-%d", k), k)
				if err != nil {
					t.Errorf("key %d copy %d: %v", k, c, err)
				}
				mu.Lock()
				status[s]++
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	if status[http.StatusCreated] != keys*copies {
		t.Fatalf("answers %v, want %d × 201", status, keys*copies)
	}
	testwait.Until(t, time.Minute, fmt.Sprintf("%d receipts", keys), func() bool {
		return countRows(t, db, `SELECT count(*) FROM receipts`) == keys
	})

	ctx := context.Background()
	conn, err := pgx.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	crossUser := func() []string {
		t.Helper()
		rows, err := conn.Query(ctx, `SELECT format('%s on %s wrote rows of %s users: %s', op, tbl, users, query) FROM cross_user.statements ORDER BY 1`)
		if err != nil {
			t.Fatal(err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	for _, s := range crossUser() {
		t.Errorf("a request's statement spans users: %s", s)
	}

	// The check records a write that spans users.
	if _, err := conn.Exec(ctx, `UPDATE orders SET status = status`); err != nil {
		t.Fatal(err)
	}
	if got := crossUser(); len(got) != 1 || !strings.HasPrefix(got[0], fmt.Sprintf("UPDATE on orders wrote rows of %d users", users)) {
		t.Errorf("after an update of every order, the check recorded %q, want that update", got)
	}
}
