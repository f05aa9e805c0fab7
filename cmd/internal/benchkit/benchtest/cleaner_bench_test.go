package benchtest_test

// The cleaner under load (issue 11, point 4: at least 100,000 expired keys
// deleted per second while creates run, and the creates' p99 during
// cleaning at most 1.5 times their p99 without). Run with
//
//	go test -run '^$' -bench BmCleaner -benchtime 1x ./pgstore/
//
// CLN_BENCH_KEYS sets how many expired keys are filled in (default
// 1,000,000), CLN_BENCH_WINDOW the length of the windows with and without
// cleaning (a Go duration, default 2s), and CLN_BENCH_BATCH /
// CLN_BENCH_PAUSE (a Go duration) override CleanOptions' BatchSize and
// Pause (default: Clean's defaults); CLN_BENCH_CLEANERS runs that many
// Clean side by side, as instances of a service do (default 1). Results are in the b.ReportMetric
// columns and the log (-test.v / -v).

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/benchkit"
	"github.com/idem-go/idem/cmd/internal/benchkit/benchtest"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// cleanerBenchClients is the number of goroutines sending creates: the issue's
// 32 clients.
const cleanerBenchClients = 32

// cleanerBenchUnanswered is how many expired keys without a response the fill
// adds: the cleaner must leave every one of them.
const cleanerBenchUnanswered = 1000

func envInt(b *testing.B, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil || n <= 0 {
		b.Fatalf("%s=%q: want a positive integer", name, s)
	}
	return n
}

// createSample is one create: when it started and how long it took.
type createSample struct {
	start time.Time
	took  time.Duration
}

// cleanWindow is a span of time during which the cleaner ran or not.
type cleanWindow struct {
	from, to time.Time
	cleaning bool
}

// quantile returns the q-quantile of lat (sorted in place).
func quantile(lat []time.Duration, q float64) time.Duration {
	if len(lat) == 0 {
		return 0
	}
	slices.Sort(lat)
	return lat[min(len(lat)-1, int(q*float64(len(lat))))]
}

// runCreates sends creates through h from cleanerBenchClients goroutines until
// stop is closed, and returns when each started and how long it took.
func runCreates(b *testing.B, h http.Handler, w *benchkit.Workload, stop <-chan struct{}) []createSample {
	var (
		mu  sync.Mutex
		all []createSample
		wg  sync.WaitGroup
	)
	for range cleanerBenchClients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := make([]createSample, 0, 4096)
			defer func() {
				mu.Lock()
				all = append(all, mine...)
				mu.Unlock()
			}()
			for {
				select {
				case <-stop:
					return
				default:
				}
				r := w.Next()
				req := httptest.NewRequest(http.MethodPost, benchkit.Path, bytes.NewReader(r.Body))
				req.Header = w.Header(r)
				rec := httptest.NewRecorder()
				t0 := time.Now()
				h.ServeHTTP(rec, req)
				mine = append(mine, createSample{t0, time.Since(t0)})
				if rec.Code != http.StatusCreated || benchkit.Replayed(rec.Header()) {
					b.Errorf("create %s: %d %s", r.Key, rec.Code, rec.Body)
					return
				}
			}
		}()
	}
	wg.Wait()
	return all
}

// pgBackends records the server processes of a pool's connections.
type pgBackends struct {
	mu   sync.Mutex
	pids []uint32
}

// cpu returns the CPU time the server processes used so far, from
// /proc/<pid>/stat (user + system; the server runs on this machine), or
// false when it cannot be read.
func (bk *pgBackends) cpu() (time.Duration, bool) {
	bk.mu.Lock()
	defer bk.mu.Unlock()
	var total time.Duration
	for _, pid := range bk.pids {
		raw, err := os.ReadFile("/proc/" + strconv.FormatUint(uint64(pid), 10) + "/stat")
		if err != nil {
			return 0, false
		}
		// Fields after the command name (in parentheses, which may hold
		// spaces): utime and stime are the 12th and 13th, in clock ticks
		// (100 a second on Linux).
		f := strings.Fields(string(raw[bytes.LastIndexByte(raw, ')')+1:]))
		if len(f) < 13 {
			return 0, false
		}
		for _, s := range f[11:13] {
			ticks, err := strconv.ParseInt(s, 10, 64)
			if err != nil {
				return 0, false
			}
			total += time.Duration(ticks) * 10 * time.Millisecond
		}
	}
	return total, true
}

// cleanerTargetPool finds the schema of the benchkit target that stored key
// (each target has a schema bench_<random> of its own, which it does not
// expose) and opens a pool of 4 connections on it, closed when b ends,
// whose server processes it records.
func cleanerTargetPool(b *testing.B, key string) (*pgxpool.Pool, string, *pgBackends) {
	ctx := context.Background()
	url := pgtest.URL(b)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT nspname FROM pg_namespace WHERE nspname LIKE 'bench\_%'`)
	if err != nil {
		b.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		b.Fatal(err)
	}
	schema := ""
	for _, n := range names {
		var found bool
		// Other runs' schemas may go away meanwhile: errors mean "not ours".
		if conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+pgx.Identifier{n, "idempotency_keys"}.Sanitize()+` WHERE key = $1)`, key).Scan(&found) == nil && found {
			schema = n
			break
		}
	}
	if schema == "" {
		b.Fatalf("no bench_ schema holds key %s", key)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		b.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = 4
	bk := &pgBackends{}
	cfg.AfterConnect = func(_ context.Context, c *pgx.Conn) error {
		bk.mu.Lock()
		defer bk.mu.Unlock()
		bk.pids = append(bk.pids, c.PgConn().PID())
		return nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pool.Close)
	return pool, schema, bk
}

// fillExpired copies the completed record of key, as the middleware stored it,
// into n expired completed keys (expiries spread over the past day, in
// insertion order) and cleanerBenchUnanswered expired keys without a response;
// then it vacuums and analyses the table, as a table in service would be.
func fillExpired(b *testing.B, pool *pgxpool.Pool, key string, n int) {
	ctx := context.Background()
	start := time.Now()
	const cols = `user_id, key, fingerprint, method, path, request_header, request_body, owner, lease_until, attempts,
	response_status, response_header, response_body, response_trailer, created_at, completed_at, expires_at`
	const chunk = 250_000
	for lo := 1; lo <= n; lo += chunk {
		hi := min(n, lo+chunk-1)
		if _, err := pool.Exec(ctx, `
INSERT INTO idempotency_keys (`+cols+`)
SELECT user_id, 'cln-expired-' || g, fingerprint, method, path, request_header, request_body, owner,
	now() - interval '2 days', attempts, response_status, response_header, response_body, response_trailer,
	now() - interval '2 days', now() - interval '2 days',
	now() - interval '1 day' + make_interval(secs => g * 86000.0 / $3)
FROM idempotency_keys, generate_series($1::int, $2::int) g
WHERE key = $4`, lo, hi, n, key); err != nil {
			b.Fatalf("filling expired keys: %v", err)
		}
	}
	if _, err := pool.Exec(ctx, `
INSERT INTO idempotency_keys (`+cols+`)
SELECT user_id, 'cln-unanswered-' || g, fingerprint, method, path, request_header, request_body, owner,
	now() - interval '2 days', attempts, NULL, NULL, NULL, NULL,
	now() - interval '2 days', NULL, now() - interval '1 day' + make_interval(secs => g)
FROM idempotency_keys, generate_series(1, $1::int) g
WHERE key = $2`, cleanerBenchUnanswered, key); err != nil {
		b.Fatalf("filling unanswered keys: %v", err)
	}
	if _, err := pool.Exec(ctx, `VACUUM (ANALYZE) idempotency_keys`); err != nil {
		b.Fatalf("VACUUM: %v", err)
	}
	// Keys expire a day after they were written, so many checkpoints
	// separate their writing from their deletion, and the first change of
	// each page after a checkpoint writes the whole page to the WAL. A
	// checkpoint here makes the deletes do the same (the server makes one
	// every checkpoint_timeout anyway), rather than depend on whether one
	// happened to come between the fill and the cleaning.
	if _, err := pool.Exec(ctx, `CHECKPOINT`); err != nil {
		b.Fatalf("CHECKPOINT: %v", err)
	}
	var size string
	if err := pool.QueryRow(ctx, `SELECT pg_size_pretty(pg_table_size('idempotency_keys'))`).Scan(&size); err != nil {
		b.Fatal(err)
	}
	b.Logf("filled %d expired completed keys and %d expired unanswered ones in %v: table %s", n, cleanerBenchUnanswered, time.Since(start).Round(time.Millisecond), size)
}

func countRows(b *testing.B, pool *pgxpool.Pool, where string) int {
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_keys WHERE `+where).Scan(&n); err != nil {
		b.Fatal(err)
	}
	return n
}

// BenchmarkCleaner fills CLN_BENCH_KEYS expired completed keys into the
// table of a benchkit target (pgstore behind the middleware, the
// one-INSERT handler), then sends creates from 32 goroutines without a
// pause while windows of CLN_BENCH_WINDOW (default 2s) alternate: one
// without cleaning, then one during which Store.Clean runs (cancelled at
// the window's end), and so on until a Clean ends by itself (no expired
// key left), then one more window without. Interleaving the windows gives
// both sides the same share of the machine's varying load. It reports the
// expired keys deleted per second of cleaning while creates ran, and the
// creates' p99 and rate with and without cleaning (each create counted in
// the window it started in). It checks what was deleted, not how fast:
// every expired completed key, and none of the unanswered or live ones.
func BenchmarkCleaner(b *testing.B) {
	nKeys := envInt(b, "CLN_BENCH_KEYS", 1_000_000)
	cleaners := envInt(b, "CLN_BENCH_CLEANERS", 1)
	window := 2 * time.Second
	if s := os.Getenv("CLN_BENCH_WINDOW"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			b.Fatalf("CLN_BENCH_WINDOW=%q: want a positive duration", s)
		}
		window = d
	}
	var opts pgstore.CleanOptions
	if os.Getenv("CLN_BENCH_BATCH") != "" {
		opts.BatchSize = envInt(b, "CLN_BENCH_BATCH", 0)
	}
	if s := os.Getenv("CLN_BENCH_PAUSE"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			b.Fatalf("CLN_BENCH_PAUSE=%q: %v", s, err)
		}
		opts.Pause = d
	}
	for b.Loop() {
		benchCleanerOnce(b, nKeys, cleaners, window, opts)
	}
}

func benchCleanerOnce(b *testing.B, nKeys, cleaners int, window time.Duration, opts pgstore.CleanOptions) {
	ctx := context.Background()
	tgt := benchtest.NewForTest(b, benchkit.Postgres, true)
	h := tgt.Handler()
	w := benchkit.NewWorkload(benchkit.Create, 8)

	probe := w.Next()
	req := httptest.NewRequest(http.MethodPost, benchkit.Path, bytes.NewReader(probe.Body))
	req.Header = w.Header(probe)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusCreated {
		b.Fatalf("probe create: %d %s", rec.Code, rec.Body)
	}
	pool, schema, backends := cleanerTargetPool(b, probe.Key)
	fillExpired(b, pool, probe.Key, nKeys)
	store := pgstore.New(pool, pgstore.Options{})

	stop := make(chan struct{})
	samplesc := make(chan []createSample)
	go func() { samplesc <- runCreates(b, h, w, stop) }()

	cpu0, cpuOK := backends.cpu()
	var (
		windows  []cleanWindow
		cleaning time.Duration
		done     bool
	)
	idle := func() {
		from := time.Now()
		time.Sleep(window) // not waiting for an outcome: an idle window the benchmark measures
		windows = append(windows, cleanWindow{from, time.Now(), false})
	}
	for round := 0; !done; round++ {
		idle()
		if round == 1000 {
			b.Fatal("expired keys left after 1000 cleaning windows")
		}
		// The window ends after the batch that passes its length: Clean's
		// pause sees the cancellation, no statement is cancelled half way.
		cctx, cancel := context.WithCancel(ctx)
		from := time.Now()
		o := opts
		o.Progress = func(int) {
			if time.Since(from) >= window {
				cancel()
			}
		}
		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			errs []error
		)
		for range cleaners {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := store.Clean(cctx, o)
				mu.Lock()
				defer mu.Unlock()
				errs = append(errs, err)
			}()
		}
		wg.Wait()
		to := time.Now()
		windows = append(windows, cleanWindow{from, to, true})
		cleaning += to.Sub(from)
		done = true
		for _, err := range errs {
			switch {
			case err == nil:
			case cctx.Err() == nil:
				b.Fatalf("Clean: %v", err)
			default:
				done = false
			}
		}
		cancel()
	}
	cpu1, cpuOK1 := backends.cpu()
	idle()
	close(stop)
	samples := <-samplesc

	// Counted in the table: a Clean cancelled while a statement ran
	// (another cleaner's window ended) may not learn that it committed.
	left := countRows(b, pool, `key LIKE 'cln-expired-%'`)
	if left != 0 {
		b.Errorf("%d of the %d expired completed keys left, want 0", left, nKeys)
	}
	deleted := nKeys - left
	if kept := countRows(b, pool, `key LIKE 'cln-unanswered-%'`); kept != cleanerBenchUnanswered {
		b.Errorf("%d expired keys without a response left, want all %d", kept, cleanerBenchUnanswered)
	}
	if live := countRows(b, pool, `key NOT LIKE 'cln-%'`); live != 1+len(samples) {
		b.Errorf("%d live keys left, want the %d created", live, 1+len(samples))
	}

	var lat [2][]time.Duration
	var span [2]time.Duration
	for _, win := range windows {
		k := 0
		if win.cleaning {
			k = 1
		}
		span[k] += win.to.Sub(win.from)
	}
	for _, s := range samples {
		i, _ := slices.BinarySearchFunc(windows, s.start, func(win cleanWindow, t time.Time) int {
			if win.to.Before(t) || win.to.Equal(t) {
				return -1
			}
			return 1
		})
		if i == len(windows) {
			continue // started after the last window
		}
		k := 0
		if windows[i].cleaning {
			k = 1
		}
		lat[k] = append(lat[k], s.took)
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	rate := [2]float64{float64(len(lat[0])) / span[0].Seconds(), float64(len(lat[1])) / span[1].Seconds()}
	p99 := [2]time.Duration{quantile(lat[0], 0.99), quantile(lat[1], 0.99)}
	b.Logf("schema %s: %d expired keys deleted by %d cleaners (%+v) in %v of cleaning, %d windows of %v",
		schema, deleted, cleaners, opts, cleaning.Round(time.Millisecond), len(windows), window)
	for k, name := range []string{"without", "with"} {
		b.Logf("creates %-7s cleaning: %6d in %6.2fs, %6.0f/s, p50 %6.2f ms, p99 %6.2f ms, max %7.2f ms",
			name, len(lat[k]), span[k].Seconds(), rate[k], ms(quantile(lat[k], 0.5)), ms(p99[k]), ms(quantile(lat[k], 1)))
	}
	b.ReportMetric(float64(deleted)/cleaning.Seconds(), "keys/s")
	if cpuOK && cpuOK1 {
		// The server's CPU time per deleted key, which the machine's load
		// does not inflate as much as the elapsed time: 1e6 / µs-per-key
		// is what one core could delete per second, pauses aside.
		b.ReportMetric(float64(cpu1-cpu0)/float64(time.Microsecond)/float64(deleted), "server-cpu-µs/key")
	}
	b.ReportMetric(ms(p99[0]), "p99-without-ms")
	b.ReportMetric(ms(p99[1]), "p99-with-ms")
	b.ReportMetric(p99[1].Seconds()/p99[0].Seconds(), "p99-with/without")
	b.ReportMetric(rate[0], "creates/s-without")
	b.ReportMetric(rate[1], "creates/s-with")
	b.ReportMetric(0, "ns/op") // one run, not an operation: the figures above are the result
}
