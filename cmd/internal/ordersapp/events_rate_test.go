package ordersapp

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem/internal/pgtest"
)

// The measurements of TestEventRatesAtScale.
const (
	// ratePoll is how often the count of what is left is read.
	ratePoll = 100 * time.Millisecond
	// rateStall fails a measurement whose count has not moved for so long.
	rateStall = 2 * time.Minute
)

// TestEventRatesAtScale measures, on PostgreSQL, the two rates at which
// the orders' events flow, for capacity sizing, on ORDERS_EVENTS_SCALE
// seeded orders (seedAuditTo), each measurement in a new database and on a
// nats-server process of its own:
//
//   - the outbox relay's: the orders' events wait unsent in idem_outbox
//     (none in stream ORDERS), then 1, and separately 2, `orders serve
//     --consume=false` processes start (their relays share the table) and
//     the clock runs until no event is unsent;
//   - the receipts consumer's: the events are sent and in stream ORDERS
//     with no receipt written, then 1, and separately 2, `orders consume`
//     processes start (no serve runs) and the clock runs until the
//     receipts table holds one receipt per order.
//
// The count is read every ratePoll. Each figure is logged on one line:
// the events, the processes, the seconds from their launch (and from when
// every one of them was ready, with the count left then) and the rate. It
// is a measurement, not a check: run it on a quiet machine, with -timeout 0
// (-run TestEventRatesAtScale/relay, or /consume, runs one half).
func TestEventRatesAtScale(t *testing.T) {
	n, err := strconv.Atoi(os.Getenv("ORDERS_EVENTS_SCALE"))
	if err != nil || n <= 0 {
		t.Skip("measures the outbox relay's events/s and the receipts consumer's receipts/s on PostgreSQL (1 and 2 processes each): " +
			"set ORDERS_EVENTS_SCALE to a number of orders (e.g. ORDERS_EVENTS_SCALE=100000 TEST_DATABASE_URL=postgres://root@127.0.0.1:5432/test " +
			"go test ./internal/ordersapp -run TestEventRatesAtScale -v -timeout 0; -run TestEventRatesAtScale/relay or /consume for one half)")
	}
	ordersBin, _ := binaries(t)
	var figures []string
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprintf("relay/%d", procs), func(t *testing.T) {
			figures = append(figures, measureRelayRate(t, ordersBin, n, procs))
		})
	}
	for _, procs := range []int{1, 2} {
		t.Run(fmt.Sprintf("consume/%d", procs), func(t *testing.T) {
			figures = append(figures, measureConsumeRate(t, ordersBin, n, procs))
		})
	}
	t.Logf("event rates on PostgreSQL:\n%s", strings.Join(figures, "\n"))
}

// rateEnv is one measurement's database, NATS and data dir, with the
// seeded orders in them.
type rateEnv struct {
	db, nats, dir string
	pool          *pgxpool.Pool // to count what is left
}

// newRateEnv seeds n orders, their events at stage, into a new database
// and stream ORDERS on a new nats-server, then vacuums and analyses the
// database, as one that has run a while.
func newRateEnv(t *testing.T, n int, stage seedStage) rateEnv {
	t.Helper()
	ctx := context.Background()
	env := rateEnv{db: pgtest.Database(t), nats: startNATSServer(t), dir: t.TempDir()}
	be, err := openBackend(ctx, &Config{DataDir: env.dir, DatabaseURL: env.db, KeyLease: seedKeyLease, PaymentsKey: seedPaymentsKey})
	if err != nil {
		t.Fatal(err)
	}
	err = seedAuditTo(ctx, t, be, natsJS(t, env.nats), 0, n, stage)
	if err == nil {
		t0 := time.Now()
		_, err = be.pg.Exec(ctx, `VACUUM (ANALYZE)`)
		t.Logf("VACUUM (ANALYZE) took %s", time.Since(t0).Round(time.Millisecond))
	}
	be.close()
	if err != nil {
		t.Fatal(err)
	}
	if env.pool, err = pgxpool.New(ctx, env.db); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(env.pool.Close)
	return env
}

// count runs query, a count, on the environment's database.
func (env rateEnv) count(t *testing.T, query string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var c int
	if err := env.pool.QueryRow(ctx, query).Scan(&c); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return c
}

// measureRelayRate times procs `orders serve --consume=false` publishing n
// unsent events, and returns the figure's line.
func measureRelayRate(t *testing.T, bin string, n, procs int) string {
	env := newRateEnv(t, n, seedUnsent)
	const unsent = `SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL`
	if left := env.count(t, unsent); left != n {
		t.Fatalf("%d unsent events seeded, want %d", left, n)
	}
	var addrs []string
	args := make([][]string, procs)
	for i := range args {
		addr := freeAddr(t)
		addrs = append(addrs, addr)
		args[i] = []string{"serve", "--addr", addr, "--data-dir", env.dir, "--database-url", env.db, "--nats-url", env.nats,
			"--jwt-secret", testSecret, "--consume=false"}
	}
	m := runRate(t, bin, args, func(i int, _ string) bool { return httpOK("http://" + addrs[i] + "/healthz") },
		func() int { return env.count(t, unsent) })

	// What each relay published, from its metrics, before it stops.
	var split []string
	for _, addr := range addrs {
		v, _ := metricValue(t, "http://"+addr+"/metrics", "orders_events_published_total")
		split = append(split, strconv.FormatFloat(v, 'f', 0, 64))
	}
	if msgs := streamMsgs(t, natsJS(t, env.nats)); msgs != uint64(n) {
		t.Errorf("stream %s holds %d messages after the relays, want %d", eventStream, msgs, n)
	}
	line := m.line(n, procs, "orders serve --consume=false", "events", "published by the relay (outbox to stream "+eventStream+")")
	t.Logf("%s; published per process: %s", line, strings.Join(split, ", "))
	return line
}

// measureConsumeRate times procs `orders consume` writing the receipts of
// n events in the stream, and returns the figure's line.
func measureConsumeRate(t *testing.T, bin string, n, procs int) string {
	env := newRateEnv(t, n, seedPublished)
	const receipts = `SELECT count(*) FROM receipts`
	if got := env.count(t, `SELECT count(*) FROM idem_outbox WHERE sent_at IS NULL`); got != 0 {
		t.Fatalf("%d unsent events seeded, want none", got)
	}
	if got := env.count(t, receipts); got != 0 {
		t.Fatalf("%d receipts seeded, want none", got)
	}
	args := make([][]string, procs)
	for i := range args {
		args[i] = []string{"consume", "--data-dir", env.dir, "--database-url", env.db, "--nats-url", env.nats}
	}
	m := runRate(t, bin, args, func(_ int, logs string) bool { return strings.Contains(logs, "orders consume: running") },
		func() int { return n - env.count(t, receipts) })

	applied := regexp.MustCompile(`orders consume: stopped; (\d+) events applied by this process`)
	var split []string
	for _, p := range m.procs {
		k := "?"
		if sm := applied.FindStringSubmatch(p.stop(t)); sm != nil {
			k = sm[1]
		}
		split = append(split, k)
	}
	if dup := env.count(t, `SELECT count(*) FROM (SELECT order_id FROM receipts GROUP BY order_id HAVING count(*) > 1) d`); dup != 0 {
		t.Errorf("%d orders with more than one receipt", dup)
	}
	line := m.line(n, procs, "orders consume", "receipts", "written by the receipts consumer (stream "+eventStream+" to receipts)")
	t.Logf("%s; applied per process: %s", line, strings.Join(split, ", "))
	return line
}

// rateRun is one measurement's processes and times.
type rateRun struct {
	procs []*rateProc
	// ready is when every process was ready, from their launch, and
	// leftAtReady the count left then; done is when none was left.
	ready, done time.Duration
	leftAtReady int
}

// line is the measurement's figure: n of what (done by procs processes of
// command) in so many seconds, and the rate.
func (m rateRun) line(n, procs int, command, what, doneBy string) string {
	after := "n/a (done before)"
	if d := m.done - m.ready; m.leftAtReady > 0 && d > 0 {
		after = fmt.Sprintf("%.0f %s/s", float64(m.leftAtReady)/d.Seconds(), what)
	}
	return fmt.Sprintf("%s %s: N=%d, processes=%d (%s), seconds=%.2f from launch, rate=%.0f %s/s; every process ready at %.2f s with %d left, %s after that",
		what, doneBy, n, procs, command, m.done.Seconds(), float64(n)/m.done.Seconds(), what, m.ready.Seconds(), m.leftAtReady, after)
}

// runRate launches one process of bin per element of args, all at once,
// and returns when left() reaches 0 (read every ratePoll), with the
// times. ready(i, logs) tells whether process i is ready. A process that
// exits, or a count that does not move for rateStall, fails t.
func runRate(t *testing.T, bin string, args [][]string, ready func(i int, logs string) bool, left func() int) rateRun {
	t.Helper()
	var m rateRun
	began := time.Now()
	for _, a := range args {
		m.procs = append(m.procs, startRateProc(t, bin, a...))
	}
	exited := func() {
		t.Helper()
		for i, p := range m.procs {
			if p.exited() {
				t.Fatalf("process %d (%s) exited:\n%s", i, strings.Join(args[i], " "), tail(p.logs.String(), 20))
			}
		}
	}
	for i, p := range m.procs {
		for !ready(i, p.logs.String()) {
			exited()
			if time.Since(began) > time.Minute {
				t.Fatalf("process %d (%s) not ready after a minute:\n%s", i, strings.Join(args[i], " "), tail(p.logs.String(), 20))
			}
			time.Sleep(10 * time.Millisecond) // a poll with a deadline: ends as soon as the process is ready
		}
	}
	m.ready = time.Since(began)
	m.leftAtReady = left()
	last, moved := m.leftAtReady, time.Now()
	for last > 0 {
		time.Sleep(ratePoll) // the measurement's sampling period
		exited()
		now := left()
		switch {
		case now != last:
			last, moved = now, time.Now()
		case time.Since(moved) > rateStall:
			for i, p := range m.procs {
				t.Logf("process %d logs:\n%s", i, tail(p.logs.String(), 20))
			}
			t.Fatalf("%d left, and no change for %s", last, rateStall)
		}
	}
	m.done = time.Since(began)
	return m
}

// rateProc is a running orders process of a measurement.
type rateProc struct {
	cmd  *exec.Cmd
	logs *syncBuffer
	wait chan struct{} // closed when it has exited
}

// startRateProc starts bin with args; t's end stops it.
func startRateProc(t *testing.T, bin string, args ...string) *rateProc {
	t.Helper()
	p := &rateProc{cmd: exec.Command(bin, args...), logs: new(syncBuffer), wait: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = p.cmd.Wait(); close(p.wait) }() // its exit status: exited tells
	t.Cleanup(func() { p.stop(t) })
	return p
}

func (p *rateProc) exited() bool {
	select {
	case <-p.wait:
		return true
	default:
		return false
	}
}

// stop sends SIGINT and waits (10s, then SIGKILL); it returns the logs.
func (p *rateProc) stop(t *testing.T) string {
	if !p.exited() {
		p.cmd.Process.Signal(os.Interrupt)
		select {
		case <-p.wait:
		case <-time.After(10 * time.Second):
			p.cmd.Process.Kill()
			<-p.wait
			t.Logf("%s did not stop on SIGINT within 10s; killed", strings.Join(p.cmd.Args, " "))
		}
	}
	return p.logs.String()
}

// httpOK reports whether a GET of url answers 200.
func httpOK(url string) bool {
	resp, err := http.Get(url)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}
