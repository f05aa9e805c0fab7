package ordersapp

import (
	"encoding/json"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/idem-go/idem/cmd/internal/benchkit"
)

// benchIfReport runs `orders bench <args> --json` and parses the report.
func benchIfReport(t *testing.T, args ...string) benchReport {
	t.Helper()
	code, out, errs := benchRunApp(t, append(append([]string{"bench"}, args...), "--json")...)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	var rep benchReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("the JSON does not parse: %v\n%s", err, out)
	}
	return rep
}

// benchIfCheckByStatus checks that by_status covers exactly the statuses,
// with their counts, and percentiles in order.
func benchIfCheckByStatus(t *testing.T, name string, st map[string]int, by map[string]benchLatency) {
	t.Helper()
	if len(by) != len(st) {
		t.Errorf("%s: by_status %v for statuses %v", name, by, st)
	}
	for c, n := range st {
		l, ok := by[c]
		if !ok || l.Requests != n {
			t.Errorf("%s: status %s: %d answers, by_status has %+v", name, c, n, l)
			continue
		}
		if l.P50 < 0 || !(l.P50 <= l.P90 && l.P90 <= l.P99 && l.P99 <= l.Max) {
			t.Errorf("%s: status %s: percentiles out of order: %+v", name, c, l)
		}
	}
}

// TestBenchInflightMemory runs inflight mode on the memory store: behind
// the middleware every measured request is a 409 (its key is held in the
// handler), the held requests answer 201 once released; the bare handler
// answers every one 201. The 409s have their own percentiles.
func TestBenchInflightMemory(t *testing.T) {
	rep := benchIfReport(t, "--store", "memory", "--mode", "inflight", "--duration", "400ms",
		"--concurrency", "8", "--keys", "16", "--users", "2", "--rounds", "2")
	if len(rep.Runs) != 4 {
		t.Fatalf("%d runs, want 4", len(rep.Runs))
	}
	for _, r := range rep.Runs {
		name := benchMW(r.Middleware) + " round " + strconv.Itoa(r.Round)
		if r.Requests == 0 {
			t.Fatalf("%s: no requests", name)
		}
		want := "201"
		if r.Middleware {
			want = "409"
		}
		if r.Statuses[want] != r.Requests || len(r.Statuses) != 1 {
			t.Errorf("%s: statuses %v, want all %s (%s)", name, r.Statuses, want, r.FirstError)
		}
		if r.Held["201"] != 16 || len(r.Held) != 1 {
			t.Errorf("%s: held requests answered %v, want 16 × 201", name, r.Held)
		}
		benchIfCheckByStatus(t, name, r.Statuses, r.ByStatus)
	}
	for _, row := range rep.Rows {
		benchIfCheckByStatus(t, "row "+benchMW(row.Middleware), row.Statuses, row.ByStatus)
		if row.Middleware {
			l := row.ByStatus["409"]
			if l.Requests != row.Requests || l.P99 != row.P99 || l.P50 != row.P50 {
				t.Errorf("the 409s' percentiles %+v are not the row's (p50 %g p99 %g)", l, row.P50, row.P99)
			}
		}
	}
	if len(rep.Ratios) != 1 || rep.Ratios[0].Mode != "inflight" {
		t.Errorf("ratios %+v", rep.Ratios)
	}
}

// TestBenchInflightByStatusTable checks the table of latencies by status:
// inflight mode's 409 row is there; duplicates mode's rows are there,
// 201 and 409 apart, exactly when some of its answers were 409 (under
// load the copies may all arrive after the first answer, and be replays).
func TestBenchInflightByStatusTable(t *testing.T) {
	code, out, errs := benchRunApp(t, "bench", "--store", "memory", "--mode", "duplicates,inflight", "--duration", "400ms",
		"--concurrency", "8", "--keys", "8", "--copies", "8")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	i := strings.Index(out, "latency by status")
	if i < 0 {
		t.Fatalf("no latency by status table:\n%s", out)
	}
	var got []string
	for _, l := range strings.Split(out[i:], "\n")[2:] {
		f := strings.Fields(l)
		if len(f) != 9 {
			break
		}
		got = append(got, strings.Join(f[:4], " "))
	}
	want := []string{"memory yes inflight 409"}
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "memory with middleware duplicates: 201:") && strings.Contains(l, " 409:") {
			want = []string{"memory yes duplicates 201", "memory yes duplicates 409", "memory yes inflight 409"}
		}
	}
	if !slices.Equal(got, want) {
		t.Errorf("latency by status rows %v, want %v\n%s", got, want, out)
	}
	if !strings.Contains(out, "memory with middleware inflight: 409:") {
		t.Errorf("statuses lack the inflight 409s:\n%s", out)
	}
}

// TestBenchPrefillPostgres runs --prefill 0,1500 on PostgreSQL (and on
// Redis in front of it when given): per store a bare target and two
// with-middleware targets, taking turns at going first; each run on a
// with-middleware target starts from its prefilled keys alone; the
// "live keys ÷ empty table" ratio is there.
func TestBenchPrefillPostgres(t *testing.T) {
	// It asserts counts and the order of the runs, not speed: it runs
	// beside the package's other parallel tests.
	t.Parallel()
	db, redis := benchServers(t)
	if db == "" {
		t.Skip("set TEST_DATABASE_URL (or CI=true) for the PostgreSQL store")
	}
	stores := []string{benchkit.Postgres}
	args := []string{"--database-url", db, "--mode", "create,inflight", "--duration", "300ms", "--concurrency", "4",
		"--keys", "4", "--rounds", "3", "--prefill", "1_500,0"}
	if redis != "" {
		stores = append(stores, benchkit.Redis)
		args = append(args, "--redis-url", redis)
	}
	rep := benchIfReport(t, append(args, "--store", strings.Join(stores, ","))...)
	if len(rep.Prefills) != len(stores) {
		t.Fatalf("prefills %+v, want one per store", rep.Prefills)
	}
	for _, p := range rep.Prefills {
		if p.Keys != 1500 || p.TableBytes <= 0 {
			t.Errorf("prefill %+v", p)
		}
	}
	if want := 3 * 2 * len(stores) * 3; len(rep.Runs) != want {
		t.Fatalf("%d runs, want %d", len(rep.Runs), want)
	}
	// Runs come in groups of three (one store, mode and round): bare,
	// empty table, 1500 keys, rotated by one each round.
	kind := func(r benchRun) int {
		switch {
		case !r.Middleware:
			return 0
		case r.Prefill == 0:
			return 1
		}
		return 2
	}
	for i := 0; i < len(rep.Runs); i += 3 {
		g := rep.Runs[i : i+3]
		first := kind(g[0])
		for j, r := range g {
			if r.Store != g[0].Store || r.Mode != g[0].Mode || r.Round != g[0].Round || kind(r) != (first+j)%3 {
				t.Fatalf("runs %d..%d are not one group in turn: %+v", i, i+2, g)
			}
			if r.Middleware && r.Mode == "create" && r.Statuses["201"] != r.Requests {
				t.Errorf("create run %+v", r)
			}
			if r.Middleware && r.Mode == "inflight" && r.Statuses["409"] != r.Requests {
				t.Errorf("inflight run %+v", r)
			}
			if !r.Middleware && r.Prefill != 0 {
				t.Errorf("bare run with a prefill: %+v", r)
			}
		}
		if first != (g[0].Round-1)%3 {
			t.Errorf("round %d starts with kind %d", g[0].Round, first)
		}
	}
	// Every with-middleware run after the first on its target deleted the
	// keys of the runs before it: inflight leaves its 4 held keys, create
	// as many as it created.
	for _, r := range rep.Runs {
		if r.Middleware && (r.Round > 1 || r.Mode == "inflight") && r.ResetKeys == 0 {
			t.Errorf("run %s %s round %d prefill %d deleted nothing before it", r.Store, r.Mode, r.Round, r.Prefill)
		}
	}
	var live int
	for _, r := range rep.Ratios {
		if strings.HasPrefix(r.Name, "1500 live keys ÷ empty table") {
			live++
			if len(r.Rounds) != 3 || r.Median <= 0 || r.Prefill != 1500 {
				t.Errorf("ratio %+v", r)
			}
		}
	}
	if live != 2*len(stores) {
		t.Errorf("%d live-keys ratios, want %d: %+v", live, 2*len(stores), rep.Ratios)
	}
	// The table shows the live keys column and the prefills.
	code, out, errs := benchRunApp(t, "bench", "--store", benchkit.Postgres, "--database-url", db, "--mode", "create",
		"--duration", "200ms", "--concurrency", "2", "--prefill", "0,10")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errs)
	}
	for _, want := range []string{"live keys", "postgres with middleware: 10 keys in", "postgres create: 10 live keys ÷ empty table, with middleware: "} {
		if !strings.Contains(out, want) {
			t.Errorf("the table lacks %q:\n%s", want, out)
		}
	}
}

// TestBenchInflightPrefillFlags checks the usage errors of the new flags.
func TestBenchInflightPrefillFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--target", "serve", "--jwt-secret", strings.Repeat("s", 32), "--mode", "inflight"}, "--mode inflight needs --target library"},
		{[]string{"--mode", "inflight", "--duration", "26s"}, "--mode inflight needs --duration of at most 25s"},
		{[]string{"--prefill", "many"}, `--prefill: "many" is not a number of keys`},
		{[]string{"--prefill", "-5"}, `--prefill: "-5" is not a number of keys`},
		{[]string{"--prefill", "0,100"}, "--prefill applies to the postgres and redis stores only"},
		{[]string{"--target", "serve", "--jwt-secret", strings.Repeat("s", 32), "--prefill", "10"}, "--prefill needs --target library"},
	} {
		code, _, errs := benchRunApp(t, append([]string{"bench"}, c.args...)...)
		if code != 2 || !strings.Contains(errs, c.want) {
			t.Errorf("bench %v: exit %d, stderr %q; want 2 and %q", c.args, code, errs, c.want)
		}
	}
	code, out, _ := benchRunApp(t, "bench", "--help")
	if code != 0 || !strings.Contains(out, "--prefill") || !strings.Contains(out, "inflight") {
		t.Errorf("--help lacks --prefill or inflight: exit %d\n%s", code, out)
	}
}
