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
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// countTally is what one request cost on the database.
type countTally struct {
	Statements int // statements sent: queries, Execs, BEGIN/COMMIT/ROLLBACK, batch members
	Prepares   int // statements prepared (first use of a text on a connection)
	RoundTrips int // writes to the server's socket: one per round trip
	Commits    int // COMMIT statements plus statements run outside a transaction (autocommit)
	Autocommit int // statements run outside a transaction
	Begins     int
	Rollbacks  int
}

func (c countTally) String() string {
	return fmt.Sprintf("statements=%d round_trips=%d commits=%d (autocommit=%d, begin=%d) rollbacks=%d prepares=%d",
		c.Statements, c.RoundTrips, c.Commits, c.Autocommit, c.Begins, c.Rollbacks, c.Prepares)
}

func (c countTally) minus(o countTally) countTally {
	return countTally{
		Statements: c.Statements - o.Statements,
		Prepares:   c.Prepares - o.Prepares,
		RoundTrips: c.RoundTrips - o.RoundTrips,
		Commits:    c.Commits - o.Commits,
		Autocommit: c.Autocommit - o.Autocommit,
		Begins:     c.Begins - o.Begins,
		Rollbacks:  c.Rollbacks - o.Rollbacks,
	}
}

// countTracer is a pgx.QueryTracer, BatchTracer and PrepareTracer that
// counts, and the socket wrapper's counter of writes.
type countTracer struct {
	mu    sync.Mutex
	t     countTally
	inTx  map[*pgx.Conn]bool
	stmts []string // the statements since the last snapshot, for failure messages
}

func newCountTracer() *countTracer { return &countTracer{inTx: map[*pgx.Conn]bool{}} }

// statement counts the statements of sql, sent on conn: one, or several
// separated by semicolons in one simple-protocol query (none of the
// statements counted here has a semicolon of its own).
func (ct *countTracer) statement(conn *pgx.Conn, sql string) {
	for part := range strings.SplitSeq(sql, ";") {
		if strings.TrimSpace(part) != "" {
			ct.one(conn, part)
		}
	}
}

// one counts one statement sent on conn.
func (ct *countTracer) one(conn *pgx.Conn, sql string) {
	ct.mu.Lock()
	defer ct.mu.Unlock()
	ct.t.Statements++
	word := strings.ToLower(strings.Fields(sql + " x")[0])
	ct.stmts = append(ct.stmts, strings.Join(strings.Fields(sql), " "))
	switch {
	case word == "begin" || strings.HasPrefix(word, "start"):
		ct.t.Begins++
		ct.inTx[conn] = true
	case word == "commit" || word == "end":
		ct.t.Commits++
		ct.inTx[conn] = false
	case word == "rollback" || word == "abort":
		ct.t.Rollbacks++
		ct.inTx[conn] = false
	case !ct.inTx[conn]:
		ct.t.Autocommit++
		ct.t.Commits++
	}
}

func (ct *countTracer) TraceQueryStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	ct.statement(conn, data.SQL)
	return ctx
}

func (ct *countTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (ct *countTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (ct *countTracer) TraceBatchQuery(_ context.Context, conn *pgx.Conn, data pgx.TraceBatchQueryData) {
	ct.statement(conn, data.SQL)
}

func (ct *countTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (ct *countTracer) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	ct.mu.Lock()
	ct.t.Prepares++
	ct.mu.Unlock()
	return ctx
}

func (ct *countTracer) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

func (ct *countTracer) wrote() {
	ct.mu.Lock()
	ct.t.RoundTrips++
	ct.mu.Unlock()
}

// snapshot returns the counts so far and forgets the statements listed.
func (ct *countTracer) snapshot() countTally {
	ct.mu.Lock()
	defer ct.mu.Unlock()
	ct.stmts = nil
	return ct.t
}

func (ct *countTracer) statements() []string {
	ct.mu.Lock()
	defer ct.mu.Unlock()
	return append([]string(nil), ct.stmts...)
}

// countConn counts the writes to a server's socket. pgconn buffers each
// operation's messages and writes them at once, then waits for the
// answer: one write is one round trip.
type countConn struct {
	net.Conn
	ct *countTracer
}

func (c *countConn) Write(b []byte) (int, error) {
	c.ct.wrote()
	return c.Conn.Write(b)
}

// countPool returns a migrated pool on a schema of the test's own, with
// ct counting on its connections and a table countfx for the handler's
// writes. The pool has one connection, never pinged on acquire, so that
// nothing but the requests' own statements reaches the server.
func countPool(t *testing.T, ct *countTracer) *pgxpool.Pool {
	t.Helper()
	pool := pgtest.Pool(t, pgtest.MaxConns(1), func(c *pgxpool.Config) {
		c.ConnConfig.Tracer = ct
		c.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
		dial := c.ConnConfig.DialFunc
		c.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := dial(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &countConn{Conn: conn, ct: ct}, nil
		}
	})
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
// it cost.
func countServe(t *testing.T, ct *countTracer, h http.Handler, key string) (int, countTally) {
	t.Helper()
	before := ct.snapshot()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, countRequest(key))
	return rec.Code, ct.snapshot().minus(before)
}

// TestCountStatementsPerRequest counts what one create, one replay and one
// in-flight 409 send to PostgreSQL, each on a connection that already ran
// the same statements (prepared, as pgx's statement cache keeps them), and
// asserts today's figures (see the file's comment).
func TestCountStatementsPerRequest(t *testing.T) {
	ct := newCountTracer()
	pool := countPool(t, ct)
	store := pgstore.New(pool, pgstore.Options{})
	h := idem.Middleware(store, idem.Options{})(http.HandlerFunc(countHandler))
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
		c, err := store.Claim(ctx, idem.ClaimParams{Key: key, Owner: idem.NewOwner(), Fingerprint: fp,
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
			t.Fatalf("first %s: status %d, want %d; statements: %q", step.name, code, step.want, ct.statements())
		}
		t.Logf("first %s (statements prepared on first use): %v", step.name, cold)
	}

	want := map[string]countTally{
		// the claim (autocommit); BEGIN with the handler's INSERT; the
		// fenced UPDATE with COMMIT.
		"create": {Statements: 5, RoundTrips: 3, Commits: 2, Autocommit: 1, Begins: 1},
		// the claim, whose INSERT … ON CONFLICT DO NOTHING inserts nothing
		// and whose SELECT reads the record, in one statement.
		"replay": {Statements: 1, RoundTrips: 1, Commits: 1, Autocommit: 1},
		// the same statement: it finds a live lease.
		"inflight": {Statements: 1, RoundTrips: 1, Commits: 1, Autocommit: 1},
	}
	check := func(name string, code, wantCode int, got countTally) {
		t.Helper()
		if code != wantCode {
			t.Fatalf("%s: status %d, want %d; statements: %q", name, code, wantCode, ct.statements())
		}
		t.Logf("%s: %v", name, got)
		if got != want[name] {
			t.Errorf("%s costs %v\nwant       %v\nstatements: %q\n(these are the minimum: a change that lowers them must lower this assertion; one that raises them is a regression)",
				name, got, want[name], ct.statements())
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
