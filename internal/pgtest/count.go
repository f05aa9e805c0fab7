package pgtest

import (
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Tally is what statements cost on the connections a Counter watches.
type Tally struct {
	Statements int // statements sent: queries, Execs, BEGIN/COMMIT/ROLLBACK, batch members
	Prepares   int // statements prepared (first use of a text on a connection)
	RoundTrips int // writes to the server's socket: one per round trip
	Commits    int // COMMIT statements plus statements run outside a transaction (autocommit)
	Autocommit int // statements run outside a transaction
	Begins     int
	Rollbacks  int
}

func (c Tally) String() string {
	return fmt.Sprintf("statements=%d round_trips=%d commits=%d (autocommit=%d, begin=%d) rollbacks=%d prepares=%d",
		c.Statements, c.RoundTrips, c.Commits, c.Autocommit, c.Begins, c.Rollbacks, c.Prepares)
}

// Minus is c less o, field by field: what was spent since o.
func (c Tally) Minus(o Tally) Tally {
	return Tally{
		Statements: c.Statements - o.Statements,
		Prepares:   c.Prepares - o.Prepares,
		RoundTrips: c.RoundTrips - o.RoundTrips,
		Commits:    c.Commits - o.Commits,
		Autocommit: c.Autocommit - o.Autocommit,
		Begins:     c.Begins - o.Begins,
		Rollbacks:  c.Rollbacks - o.Rollbacks,
	}
}

// Counter counts statements, commits and round trips on the connections
// of a pool made by CountingPool: it is the pool's pgx.QueryTracer,
// BatchTracer and PrepareTracer, and counts the writes to each
// connection's socket (pgconn writes an operation's messages at once and
// then waits: one write is one round trip). Tests that count, not time,
// assert its Tally.
type Counter struct {
	mu    sync.Mutex
	t     Tally
	inTx  map[*pgx.Conn]bool
	stmts []string // the statements since the last Snapshot, for failure messages
}

// NewCounter returns a Counter with nothing counted.
func NewCounter() *Counter { return &Counter{inTx: map[*pgx.Conn]bool{}} }

// statement counts the statements of sql, sent on conn: one, or several
// separated by semicolons in one simple-protocol query (statements with a
// semicolon of their own are not counted right).
func (c *Counter) statement(conn *pgx.Conn, sql string) {
	for part := range strings.SplitSeq(sql, ";") {
		if strings.TrimSpace(part) != "" {
			c.one(conn, part)
		}
	}
}

// one counts one statement sent on conn.
func (c *Counter) one(conn *pgx.Conn, sql string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t.Statements++
	word := strings.ToLower(strings.Fields(sql + " x")[0])
	c.stmts = append(c.stmts, strings.Join(strings.Fields(sql), " "))
	switch {
	case word == "begin" || strings.HasPrefix(word, "start"):
		c.t.Begins++
		c.inTx[conn] = true
	case word == "commit" || word == "end":
		c.t.Commits++
		c.inTx[conn] = false
	case word == "rollback" || word == "abort":
		c.t.Rollbacks++
		c.inTx[conn] = false
	case !c.inTx[conn]:
		c.t.Autocommit++
		c.t.Commits++
	}
}

func (c *Counter) TraceQueryStart(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	c.statement(conn, data.SQL)
	return ctx
}

func (c *Counter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *Counter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (c *Counter) TraceBatchQuery(_ context.Context, conn *pgx.Conn, data pgx.TraceBatchQueryData) {
	c.statement(conn, data.SQL)
}

func (c *Counter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (c *Counter) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	c.mu.Lock()
	c.t.Prepares++
	c.mu.Unlock()
	return ctx
}

func (c *Counter) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

// Snapshot returns the counts so far and forgets the statements listed.
func (c *Counter) Snapshot() Tally {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stmts = nil
	return c.t
}

// Statements lists the statements counted since the last Snapshot.
func (c *Counter) Statements() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.stmts...)
}

// countingConn counts the writes to a server's socket.
type countingConn struct {
	net.Conn
	c *Counter
}

func (cc *countingConn) Write(b []byte) (int, error) {
	cc.c.mu.Lock()
	cc.c.t.RoundTrips++
	cc.c.mu.Unlock()
	return cc.Conn.Write(b)
}

// CountingPool is Pool with c counting on its one connection, never
// pinged on acquire, so that nothing but the test's own statements
// reaches the server.
func CountingPool(t testing.TB, c *Counter) *pgxpool.Pool {
	t.Helper()
	return Pool(t, MaxConns(1), func(cfg *pgxpool.Config) {
		cfg.ConnConfig.Tracer = c
		cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
		dial := cfg.ConnConfig.DialFunc
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := dial(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return &countingConn{Conn: conn, c: c}, nil
		}
	})
}
