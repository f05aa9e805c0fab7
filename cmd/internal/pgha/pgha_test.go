package pgha

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// TestFormation: the formation comes up with a synchronous standby; rows
// committed through the formation's URL before `pg_autoctl perform
// failover` (no write during it) are there after it, read through the
// same URL from the other node; the old primary rejoins as a synchronous
// standby; teardown leaves no process and no directory. Kill is exercised
// by cmd/internal/ordersapp's TestFailoverPostgres.
func TestFormation(t *testing.T) {
	var dir string
	t.Run("formation", func(t *testing.T) {
		f := Start(t, 1)
		dir = f.dir
		t.Logf("setup took %v; URL %s", f.SetupTook.Round(time.Millisecond), f.URL())
		s := f.RequireSynchronous(t, time.Minute)
		t.Logf("%s", s)
		if s.Primary != "node1" {
			t.Fatalf("primary %s, want node1", s.Primary)
		}
		ctx := context.Background()
		exec := func(sql string) {
			t.Helper()
			conn, err := pgx.Connect(ctx, f.URL())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctx)
			if _, err := conn.Exec(ctx, sql); err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
		}
		exec(`CREATE TABLE pgha_probe (n int)`)
		exec(`INSERT INTO pgha_probe SELECT generate_series(1, 100)`)

		p, writable, cmd := f.Failover(t)
		t.Logf("perform failover: %s took writes after %v, the command returned after %v", p.Name, writable.Round(time.Millisecond), cmd.Round(time.Millisecond))
		if p.Name != "node2" {
			t.Fatalf("new primary %s, want node2", p.Name)
		}
		exec(`INSERT INTO pgha_probe VALUES (101)`)
		s = f.RequireSynchronous(t, time.Minute)
		t.Logf("after the failover: %s", s)
		if s.Primary != "node2" {
			t.Errorf("primary %s after the failover, want node2", s.Primary)
		}

		conn, err := pgx.Connect(ctx, f.URL())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		var n int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM pgha_probe`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 101 {
			t.Errorf("%d rows after the failover, want 101", n)
		}
		if t.Failed() {
			t.Logf("monitor events:\n%s", f.Events(30))
		}
	})
	if dir == "" {
		return // skipped
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("%s left behind (%v)", dir, err)
	}
	if left := processesOn(dir); len(left) > 0 {
		t.Errorf("processes left on %s: %v", dir, left)
	}
}

func processesOn(dir string) []string {
	var left []string
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if c := cmdline(atoi(e.Name())); strings.Contains(c, dir) {
			left = append(left, c)
		}
	}
	return left
}

func atoi(s string) int {
	n := 0
	for _, r := range s {
		if r < '0' || r > '9' {
			return -1
		}
		n = n*10 + int(r-'0')
	}
	return n
}
