package pgstore_test

// Tests that count, not time (issue 11, point 3): the PostgreSQL
// statements, round trips and commits of one create, one replay and one
// in-flight 409 through idem.Middleware on a pgstore.Store, counted with a
// pgx tracer on the pool's connections and a wrapper of their sockets.
//
// The asserted figures are the minimum for this protocol: a create is the
// claim (one autocommit statement that inserts the key or reads it), BEGIN
// sent with the handler's INSERT, and the fenced UPDATE sent with COMMIT:
// 5 statements in 3 round trips, 2 commits. A replay and a 409 are the
// claim alone, which finds the key and reads it in the same statement. An
// optimisation that lowers one of them must lower the assertion with it;
// a change that raises one fails here, in CI.

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// countPool returns a migrated pool on a schema of the test's own, with
// ct counting on its one connection (pgtest.CountingPool) and a table
// countfx for the handler's writes.
func countPool(t *testing.T, ct *pgtest.Counter) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.CountingPool(t, ct)
	ctx := context.Background()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE countfx (id bigserial PRIMARY KEY, note text NOT NULL)`); err != nil {
		t.Fatalf("creating countfx: %v", err)
	}
	return pool
}

// countBody is the ~200-byte answer of countHandler.
var countBody = []byte(`{"id":"ord_0123456789abcdef","object":"order","status":"created","amount":1999,"currency":"eur","items":[{"sku":"sku_42","quantity":1}],"created":1767225600,"metadata":{"source":"count_test"}}` + "\n")

// countHandler INSERTs one row in the request's transaction and answers
// 201 with countBody.
func countHandler(w http.ResponseWriter, r *http.Request) {
	tx, err := pgstore.FromContext(r.Context())
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	if _, err := tx.Exec(r.Context(), `INSERT INTO countfx (note) VALUES ($1)`, "order"); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/orders/ord_0123456789abcdef")
	w.WriteHeader(http.StatusCreated)
	w.Write(countBody)
}

const countRequestBody = `{"sku":"sku_42","quantity":1,"currency":"eur"}`

func countRequest(key string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(countRequestBody))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("Idempotency-Key", key)
	return r
}

// countServe sends one request with key and returns its status and what
// it cost; lastStatements then holds the statements it sent.
func countServe(t *testing.T, ct *pgtest.Counter, h http.Handler, key string) (int, pgtest.Tally) {
	t.Helper()
	before := ct.Snapshot()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, countRequest(key))
	lastStatements = ct.Statements()
	return rec.Code, ct.Snapshot().Minus(before)
}

// lastStatements are the statements of countServe's last request.
var lastStatements []string

// TestCountStatementsPerRequest counts what one create, one replay and one
// in-flight 409 send to PostgreSQL, each on a connection that already ran
// the same statements (prepared, as pgx's statement cache keeps them), and
// asserts today's figures (see the file's comment).
func TestCountStatementsPerRequest(t *testing.T) {
	ct := pgtest.NewCounter()
	pool := countPool(t, ct)
	store := pgstore.New(pool, pgstore.Options{})
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(countHandler))
	ctx := context.Background()

	// A first create, replay and 409 prepare the statements on the
	// pool's one connection; their cost is logged, not asserted.
	inflight := func(key string) {
		// Another attempt holds key: a claim with the request's fingerprint.
		r := countRequest(key)
		fp, err := idem.Fingerprint(r, []byte(countRequestBody))
		if err != nil {
			t.Fatal(err)
		}
		c, err := store.Claim(ctx, idemdriver.ClaimParams{Key: key, Owner: idemdriver.NewOwner(), Fingerprint: fp,
			Method: r.Method, Path: r.URL.RequestURI(), Body: []byte(countRequestBody), Lease: idem.DefaultLease, TTL: idem.DefaultTTL})
		if err != nil || c.Lease == nil {
			t.Fatalf("holding %s: %+v, %v", key, c, err)
		}
	}
	for _, step := range []struct {
		name string
		key  string
		want int
		pre  func(string)
	}{
		{"create", "count-warm", http.StatusCreated, nil},
		{"replay", "count-warm", http.StatusCreated, nil},
		{"inflight", "count-warm-held", http.StatusConflict, inflight},
	} {
		if step.pre != nil {
			step.pre(step.key)
		}
		code, cold := countServe(t, ct, h, step.key)
		if code != step.want {
			t.Fatalf("first %s: status %d, want %d; statements: %q", step.name, code, step.want, ct.Statements())
		}
		t.Logf("first %s (statements prepared on first use): %v", step.name, cold)
	}

	want := map[string]pgtest.Tally{
		// the claim (autocommit); BEGIN with the handler's INSERT; the
		// fenced UPDATE with COMMIT.
		"create": {Statements: 5, RoundTrips: 3, Commits: 2, Autocommit: 1, Begins: 1},
		// the claim, whose INSERT … ON CONFLICT DO NOTHING inserts nothing
		// and whose SELECT reads the record, in one call of idem_claim.
		"replay": {Statements: 1, RoundTrips: 1, Commits: 1, Autocommit: 1},
		// the same statement: it finds a live lease.
		"inflight": {Statements: 1, RoundTrips: 1, Commits: 1, Autocommit: 1},
	}
	check := func(name string, code, wantCode int, got pgtest.Tally) {
		t.Helper()
		if code != wantCode {
			t.Fatalf("%s: status %d, want %d; statements: %q", name, code, wantCode, ct.Statements())
		}
		t.Logf("%s: %v", name, got)
		if got != want[name] {
			t.Errorf("%s costs %v\nwant       %v\nstatements: %q\n(these are the minimum: a change that lowers them must lower this assertion; one that raises them is a regression)",
				name, got, want[name], ct.Statements())
		}
	}

	// Three rounds, each on new keys: every round must cost the same.
	for i := range 3 {
		key := fmt.Sprintf("count-%d", i)
		code, got := countServe(t, ct, h, key)
		check("create", code, http.StatusCreated, got)
		var rows int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM countfx`).Scan(&rows); err != nil {
			t.Fatal(err)
		}
		if rows != i+2 { // the warm-up's row and one per create
			t.Fatalf("after create %d: %d rows in countfx, want %d", i, rows, i+2)
		}
		code, got = countServe(t, ct, h, key)
		check("replay", code, http.StatusCreated, got)
		// The claim is the call of idem_claim, whose plan PostgreSQL
		// keeps, not the insert-or-read's text (parsed and planned on
		// every claim in this pool's mode).
		if stmts := lastStatements; len(stmts) != 1 || !strings.Contains(stmts[0], "idem_claim(") {
			t.Errorf("replay sent %q, want one call of idem_claim", stmts)
		}

		held := fmt.Sprintf("count-held-%d", i)
		inflight(held)
		code, got = countServe(t, ct, h, held)
		check("inflight", code, http.StatusConflict, got)
	}
	// The replays ran nothing: one row per create.
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM countfx`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != 4 {
		t.Fatalf("%d rows in countfx, want 4 (one per create)", rows)
	}
}
