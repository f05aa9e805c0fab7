package faultproxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/testwait"
)

// echoServer answers each line with the same line, on 127.0.0.1.
func echoServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

// A partition holds both directions without losing a byte: a line sent
// during it arrives, answered, after the heal; latency delays the answer.
func TestPartitionHoldsThenDelivers(t *testing.T) {
	p := New(t, "echo", echoServer(t))
	c, err := net.Dial("tcp", p.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	roundTrip := func(line string) (string, error) {
		if _, err := fmt.Fprintln(c, line); err != nil {
			return "", err
		}
		return r.ReadString('\n')
	}
	if got, err := roundTrip("before"); err != nil || got != "before\n" {
		t.Fatalf("before the partition: %q %v", got, err)
	}

	p.Partition()
	if _, err := fmt.Fprintln(c, "during"); err != nil {
		t.Fatal(err)
	}
	got := make(chan string, 1)
	go func() {
		s, _ := r.ReadString('\n')
		got <- s
	}()
	select {
	case s := <-got:
		t.Fatalf("answer %q crossed the partition", s)
	case <-time.After(300 * time.Millisecond):
	}
	if p.Held() == 0 {
		t.Fatal("the partition held no chunk")
	}
	p.Heal()
	if s := <-got; s != "during\n" {
		t.Fatalf("after the heal: %q, want the held line", s)
	}

	remove, err := p.Latency(Downstream, 200*time.Millisecond, 0)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	if got, err := roundTrip("slow"); err != nil || got != "slow\n" {
		t.Fatalf("with latency: %q %v", got, err)
	}
	if d := time.Since(t0); d < 200*time.Millisecond {
		t.Errorf("answer after %v with 200ms of latency", d)
	}
	remove()
	if got, err := roundTrip("after"); err != nil || got != "after\n" {
		t.Fatalf("latency removed: %q %v", got, err)
	}
}

// The commit cut: through the proxy, a marked transaction's COMMIT fails
// for the client (the connection ends), yet the row it wrote is there;
// an unmarked transaction commits as usual; a marked transaction that the
// server rolls back at COMMIT is cut too and counted apart. Both
// protocols pgx uses are read: the extended one (Parse/Bind) and simple
// queries.
func TestCommitCut(t *testing.T) {
	dbURL, schema := pgtest.Schema(t)
	ctx := context.Background()
	direct, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close(ctx)
	table := schema + ".cut_t"
	if _, err := direct.Exec(ctx, "CREATE TABLE "+table+" (id text PRIMARY KEY, v int NOT NULL DEFAULT 0)"); err != nil {
		t.Fatal(err)
	}
	if _, err := direct.Exec(ctx, "INSERT INTO "+table+" SELECT g::text FROM generate_series(1, 100) g"); err != nil {
		t.Fatal(err)
	}

	p := New(t, "pg", hostPort(t, dbURL), WithCommitCut("SET v = v + 1", 0))
	p.SetCutFraction(1)
	through := p.PostgresURL(dbURL)
	value := func(id string) int {
		var v int
		if err := direct.QueryRow(ctx, "SELECT v FROM "+table+" WHERE id = $1", id).Scan(&v); err != nil {
			t.Fatal(err)
		}
		return v
	}

	const n = 5
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		for i := 0; i < n; i++ {
			id := fmt.Sprint(int(mode)*10 + i + 1)
			conn, err := pgx.Connect(ctx, through)
			if err != nil {
				t.Fatal(err)
			}
			// An unmarked transaction on the same connection first.
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, "UPDATE "+table+" SET v = v WHERE id = $1", mode, id); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatalf("unmarked commit (%v): %v", mode, err)
			}
			tx, err = conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := tx.Exec(ctx, "UPDATE "+table+" SET v = v + 1 WHERE id = $1", mode, id); err != nil {
				t.Fatal(err)
			}
			err = tx.Commit(ctx)
			if err == nil {
				t.Errorf("marked commit (%v) answered", mode)
			}
			conn.Close(ctx)
			if v := value(id); v != 1 {
				t.Errorf("row %s after the cut commit (%v): v = %d, want 1 (committed)", id, mode, v)
			}
		}
	}

	// A marked transaction that fails before COMMIT: the server answers
	// ROLLBACK, the cut still happens, counted as not committed.
	conn, err := pgx.Connect(ctx, through)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "UPDATE "+table+" SET v = v + 1 WHERE id = $1", "99"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT 1/0"); err == nil {
		t.Fatal("1/0 succeeded")
	}
	if err := tx.Commit(ctx); err == nil || errors.Is(err, pgx.ErrTxCommitRollback) {
		t.Errorf("commit of the failed transaction: %v, want the connection's end", err)
	}
	conn.Close(ctx)
	if v := value("99"); v != 0 {
		t.Errorf("row 99: v = %d, want 0 (rolled back)", v)
	}

	// Fraction 0: nothing is cut.
	p.SetCutFraction(0)
	conn, err = pgx.Connect(ctx, through)
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "UPDATE "+table+" SET v = v + 1 WHERE id = $1", "100")
		return err
	}); err != nil {
		t.Errorf("commit with fraction 0: %v", err)
	}
	conn.Close(ctx)

	st := p.CommitStats()
	cuts := p.Cuts()
	t.Logf("stats %+v; cuts %v", st, cuts)
	want := int64(3*n + 1)
	if st.Marked != want+1 || st.Armed != want || st.Cut != want || st.CutCommitted != 3*n || st.PairingErrors != 0 || st.Opaque != 0 {
		t.Errorf("stats %+v: want %d marked, %d armed and cut, %d of them committed, no pairing error, nothing opaque", st, want+1, want, 3*n)
	}
	if len(cuts) != int(want) {
		t.Fatalf("%d cuts recorded, want %d", len(cuts), want)
	}
	for i, c := range cuts[:3*n] {
		// The simple protocol sends no parameters: its cuts name none.
		if c.Outcome != "COMMIT" || (i < 2*n) != (len(c.Params) == 1) {
			t.Errorf("cut %d: %+v, want a COMMIT, with the row's id unless sent as a simple query", i, c)
		}
	}
	if c := cuts[3*n]; c.Outcome != "ROLLBACK" || len(c.Params) != 1 || c.Params[0] != "99" {
		t.Errorf("last cut: %+v, want a ROLLBACK of row 99", c)
	}
}

func hostPort(t *testing.T, u string) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(u)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort(cfg.Host, fmt.Sprint(cfg.Port))
}

// PartitionAt holds a marked transaction at the point named: before the
// marked statement (the server never saw it: its row is free), or before
// the COMMIT (the statement ran: its row stays locked until the heal).
func TestPartitionAt(t *testing.T) {
	dbURL, schema := pgtest.Schema(t)
	ctx := context.Background()
	direct, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close(ctx)
	table := schema + ".hold_t"
	if _, err := direct.Exec(ctx, "CREATE TABLE "+table+" (id text PRIMARY KEY, v int NOT NULL DEFAULT 0); INSERT INTO "+table+" VALUES ('a'), ('b')"); err != nil {
		t.Fatal(err)
	}
	p := New(t, "pg", hostPort(t, dbURL), WithCommitCut("SET v = v + 1"))
	through := p.PostgresURL(dbURL)
	locked := func(id string) bool {
		tx, err := direct.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		_, err = tx.Exec(ctx, "SELECT 1 FROM "+table+" WHERE id = $1 FOR UPDATE NOWAIT", id)
		return err != nil
	}

	for i, tc := range []struct {
		point      PartitionPoint
		id         string
		wantLocked bool
	}{{BeforeMarked, "a", false}, {BeforeCommit, "b", true}} {
		conn, err := pgx.Connect(ctx, through)
		if err != nil {
			t.Fatal(err)
		}
		p.PartitionAt(tc.point)
		done := make(chan error, 1)
		go func() {
			done <- pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "UPDATE "+table+" SET v = v + 1 WHERE id = $1", tc.id)
				return err
			})
		}()
		testwait.Until(t, 0, string(tc.point)+" partition", func() bool {
			if len(done) > 0 {
				t.Fatalf("%s: the transaction ended before the partition: %v", tc.point, <-done)
			}
			return p.Triggered() >= int64(i+1)
		})
		time.Sleep(100 * time.Millisecond) // not waiting for an outcome: a window in which the transaction must not cross the partition
		if len(done) > 0 {
			t.Fatalf("%s: the transaction crossed the partition: %v", tc.point, <-done)
		}
		if got := locked(tc.id); got != tc.wantLocked {
			t.Errorf("%s: row %s locked during the partition: %v, want %v", tc.point, tc.id, got, tc.wantLocked)
		}
		p.Heal()
		if err := <-done; err != nil {
			t.Errorf("%s: after the heal: %v", tc.point, err)
		}
		conn.Close(ctx)
		var v int
		if err := direct.QueryRow(ctx, "SELECT v FROM "+table+" WHERE id = $1", tc.id).Scan(&v); err != nil || v != 1 {
			t.Errorf("%s: v = %d (%v) after the heal, want 1", tc.point, v, err)
		}
	}
}
