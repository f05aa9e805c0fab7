package ordersapp

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/benchkit"
	"github.com/idem-go/idem/cmd/internal/benchkit/benchtest"
	"github.com/idem-go/idem/internal/pgtest"
)

// benchRunApp runs `orders <args>` with an empty environment and returns
// the exit status, stdout and stderr.
func benchRunApp(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	app := &App{Stdout: &out, Stderr: &errb, Getenv: func(string) string { return "" }}
	code := app.Run(context.Background(), args)
	return code, out.String(), errb.String()
}

// benchServers returns the PostgreSQL and Redis URLs the library run may
// use: from TEST_DATABASE_URL and TEST_REDIS_URL, or under CI=true the
// machine's (which must answer); "" when neither is set.
func benchServers(t *testing.T) (db, redis string) {
	t.Helper()
	if os.Getenv("TEST_DATABASE_URL") != "" || os.Getenv("CI") == "true" {
		db = pgtest.URL(t)
		if os.Getenv("TEST_REDIS_URL") != "" || os.Getenv("CI") == "true" {
			redis = benchtest.RedisURL(t)
		}
	}
	return db, redis
}

// benchCheckRun checks the counts of one run against what its mode and
// target promise; nothing is timed.
func benchCheckRun(t *testing.T, r benchRun, copies int) {
	t.Helper()
	name := r.Store + "/" + benchMW(r.Middleware) + "/" + r.Mode
	if r.Requests == 0 {
		t.Errorf("%s: no requests", name)
		return
	}
	sum := 0
	for _, n := range r.Statuses {
		sum += n
	}
	if sum != r.Requests {
		t.Errorf("%s: statuses %v add up to %d, not the %d requests", name, r.Statuses, sum, r.Requests)
	}
	ok := r.Statuses["201"]
	switch {
	case r.Mode == "duplicates" && r.Middleware:
		// Each key ran once: the other copies were replayed or in flight.
		if ok+r.Statuses["409"] != r.Requests {
			t.Errorf("%s: statuses %v, want only 201 and 409 (%s)", name, r.Statuses, r.FirstError)
		}
		keys := (r.Requests + copies - 1) / copies
		if fresh := ok - r.Replayed; fresh < 1 || fresh > keys {
			t.Errorf("%s: %d first answers (201 not replayed) for %d requests of %d keys", name, fresh, r.Requests, keys)
		}
	case r.Mode == "replay" && r.Middleware:
		if ok != r.Requests || r.Replayed != r.Requests {
			t.Errorf("%s: %d requests, %d 201, %d replayed; want every one a replayed 201 (%v)", name, r.Requests, ok, r.Replayed, r.Statuses)
		}
	default:
		// create, nokey, and everything the bare handler answers: a fresh 201.
		if ok != r.Requests || r.Replayed != 0 {
			t.Errorf("%s: %d requests, %d 201, %d replayed; want every one a fresh 201 (%v, %s)", name, r.Requests, ok, r.Replayed, r.Statuses, r.FirstError)
		}
	}
}

// TestBenchLibraryJSON runs `orders bench --target library --json` briefly
// on memory and SQLite (and PostgreSQL and Redis in front of it when their
// servers are given, always under CI) in three modes and two rounds, and
// checks that the JSON parses and that its counts agree with each other
// and with what each mode promises.
func TestBenchLibraryJSON(t *testing.T) {
	skipInShort(t, "runs the load tool against every library configuration")
	// It asserts counts, not speed: it runs beside the package's other
	// parallel tests, so the figures it logs in CI are not for a note.
	t.Parallel()
	stores := []string{benchkit.Memory, benchkit.SQLite}
	args := []string{"bench", "--target", "library", "--mode", "create,replay,duplicates",
		"--duration", "500ms", "--concurrency", "8", "--users", "3", "--keys", "16", "--copies", "4", "--rounds", "2", "--json"}
	db, redis := benchServers(t)
	if db != "" {
		stores = append(stores, benchkit.Postgres)
		args = append(args, "--database-url", db)
	}
	if redis != "" {
		stores = append(stores, benchkit.Redis)
		args = append(args, "--redis-url", redis)
	}
	t.Logf("stores: %v", stores)
	args = append(args, "--store", strings.Join(stores, ","))
	code, out, errs := benchRunApp(t, args...)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	var rep benchReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("the JSON does not parse: %v\n%s", err, out)
	}
	modes := []string{"create", "replay", "duplicates"}
	if want := len(stores) * 2 * len(modes) * 2; len(rep.Runs) != want {
		t.Fatalf("%d runs, want %d", len(rep.Runs), want)
	}
	for _, r := range rep.Runs {
		benchCheckRun(t, r, 4)
	}
	// Round 1 runs each store bare first, round 2 with the middleware first.
	for i := 0; i+1 < len(rep.Runs); i += 2 {
		a, b := rep.Runs[i], rep.Runs[i+1]
		if a.Store != b.Store || a.Mode != b.Mode || a.Round != b.Round || a.Middleware == b.Middleware {
			t.Fatalf("runs %d and %d are not a pair: %+v %+v", i, i+1, a, b)
		}
		if a.Middleware != (a.Round%2 == 0) {
			t.Errorf("round %d ran %s first", a.Round, benchMW(a.Middleware))
		}
	}
	if want := len(stores) * 2 * len(modes); len(rep.Rows) != want {
		t.Fatalf("%d rows, want %d", len(rep.Rows), want)
	}
	for _, row := range rep.Rows {
		req, st := 0, map[string]int{}
		for _, r := range rep.Runs {
			if r.Store == row.Store && r.Middleware == row.Middleware && r.Mode == row.Mode {
				req += r.Requests
				for k, n := range r.Statuses {
					st[k] += n
				}
			}
		}
		if row.Rounds != 2 || row.Requests != req || !mapsEqualBench(row.Statuses, st) {
			t.Errorf("row %s/%v/%s: rounds %d, requests %d, statuses %v; the runs add up to %d, %v", row.Store, row.Middleware, row.Mode, row.Rounds, row.Requests, row.Statuses, req, st)
		}
		if row.Throughput <= 0 || !(row.P50 <= row.P90 && row.P90 <= row.P99 && row.P99 <= row.Max) {
			t.Errorf("row %s/%v/%s: throughput %g, percentiles %g %g %g %g out of order", row.Store, row.Middleware, row.Mode, row.Throughput, row.P50, row.P90, row.P99, row.Max)
		}
	}
	wantRatios := len(stores) * len(modes)
	if slices.Contains(stores, benchkit.Redis) {
		wantRatios += len(modes)
	}
	if len(rep.Ratios) != wantRatios {
		t.Fatalf("%d ratios, want %d: %+v", len(rep.Ratios), wantRatios, rep.Ratios)
	}
	for _, r := range rep.Ratios {
		if len(r.Rounds) != 2 || r.Median <= 0 || r.Median != benchMedian(r.Rounds) {
			t.Errorf("ratio %+v: want two rounds and their median", r)
		}
	}
}

func mapsEqualBench(a, b map[string]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// TestBenchTable checks the tables: the header, a row per target and mode,
// the statuses and the ratios.
func TestBenchTable(t *testing.T) {
	code, out, errs := benchRunApp(t, "bench", "--store", "memory", "--mode", "nokey,create", "--duration", "300ms", "--concurrency", "4")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	for _, want := range []string{
		"orders bench: target library, 4 clients, 300ms per run, 1 user(s), 1 round(s)",
		"target", "store", "middleware", "mode", "requests", "req/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "replayed",
		"memory bare nokey: 201:", "memory with middleware nokey: 201:",
		"memory bare create: 201:", "memory with middleware create: 201:",
		"memory nokey: with middleware ÷ without: ", "memory create: with middleware ÷ without: ",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("the output lacks %q:\n%s", want, out)
		}
	}
	rows := 0
	for _, l := range strings.Split(out, "\n") {
		if f := strings.Fields(l); len(f) == 11 && f[0] == "library" && f[1] == "memory" {
			rows++
		}
	}
	if rows != 4 {
		t.Errorf("%d table rows, want 4:\n%s", rows, out)
	}
	if errs != "" {
		t.Errorf("stderr is not a terminal and --progress is off, yet: %q", errs)
	}
}

// TestBenchServeTarget loads an in-process `orders serve` (SQLite) with
// bearer tokens of two users: creates answer 201, replays are replays.
func TestBenchServeTarget(t *testing.T) {
	dir := t.TempDir()
	in := startInProcess(t, &Config{DataDir: dir, JWTSecret: testSecret, PaymentsKey: "sk_test_local",
		KeyTTL: 24 * time.Hour, KeyLease: 30 * time.Second, RequireKey: true})
	code, out, errs := benchRunApp(t, "bench", "--target", "serve", "--url", in.base, "--jwt-secret", testSecret,
		"--mode", "create,replay,nokey", "--duration", "500ms", "--concurrency", "4", "--users", "2", "--keys", "8", "--json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	var rep benchReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("the JSON does not parse: %v\n%s", err, out)
	}
	if len(rep.Runs) != 3 || len(rep.Ratios) != 0 {
		t.Fatalf("%d runs and %d ratios, want 3 and none", len(rep.Runs), len(rep.Ratios))
	}
	for _, r := range rep.Runs {
		if r.Target != "serve" || !r.Middleware {
			t.Errorf("run %+v", r)
		}
		if r.Mode == "nokey" {
			// serve requires a key: every request is refused with 400.
			if r.Requests == 0 || r.Statuses["400"] != r.Requests {
				t.Errorf("nokey against serve: %d requests, statuses %v; want all 400", r.Requests, r.Statuses)
			}
			continue
		}
		benchCheckRun(t, r, 4)
	}
}

// TestBenchFlags checks --help and the usage errors (exit 2).
func TestBenchFlags(t *testing.T) {
	code, out, _ := benchRunApp(t, "bench", "--help")
	if code != 0 || !strings.Contains(out, "--target") || !strings.Contains(out, "--rounds") || !strings.Contains(out, "--jwt-secret") {
		t.Errorf("--help: exit %d\n%s", code, out)
	}
	code, out, _ = benchRunApp(t, "--help")
	if code != 0 || !strings.Contains(out, "bench ") {
		t.Errorf("orders --help does not list bench: exit %d\n%s", code, out)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--target", "nowhere"}, "--target must be library or serve"},
		{[]string{"--mode", "bogus"}, `unknown mode "bogus"`},
		{[]string{"--mode", ","}, "--mode is empty"},
		{[]string{"--store", "mysql"}, `unknown store "mysql"`},
		{[]string{"--store", "postgres"}, "need --database-url"},
		{[]string{"--store", "redis", "--database-url", "postgres://x"}, "needs --redis-url"},
		{[]string{"--concurrency", "0"}, "must be an integer in 1..4096"},
		{[]string{"--duration", "0s"}, "--duration must be positive"},
		{[]string{"--duration", "soon"}, "not a duration"},
		{[]string{"--target", "serve", "--url", "ftp://x"}, "is not an http:// or https:// URL"},
		{[]string{"--target", "serve", "--data-dir", t.TempDir()}, "needs --jwt-secret"},
		{[]string{"--target", "serve", "--jwt-secret", "short"}, "want at least 32"},
		{[]string{"extra"}, `unexpected argument "extra"`},
	} {
		code, _, errs := benchRunApp(t, append([]string{"bench"}, c.args...)...)
		if code != 2 || !strings.Contains(errs, c.want) {
			t.Errorf("bench %v: exit %d, stderr %q; want 2 and %q", c.args, code, errs, c.want)
		}
	}
}
