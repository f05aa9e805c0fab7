package ordersapp

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/benchkit"
	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/orders"
	vegeta "github.com/tsenart/vegeta/v12/lib"
)

// benchInflightMaxDuration bounds --duration in inflight mode: the held
// requests' leases (idem.DefaultLease) must outlast the run.
const benchInflightMaxDuration = idem.DefaultLease - 5*time.Second

// benchOrderBody is what `orders bench --target serve` posts: one item.
var benchOrderBody = []byte(`{"items":[{"sku":"SKU-1","quantity":2,"unit_price":1299}],"currency":"EUR"}`)

// benchOptions is what the flags of `orders bench` set.
type benchOptions struct {
	target      string
	stores      []string
	modes       []benchkit.Mode
	databaseURL string
	redisURL    string
	serveURL    string
	concurrency int
	duration    time.Duration
	users       int
	rounds      int
	keys        int
	copies      int
	json        bool
	progress    bool
	// prefills are the --prefill sizes: one with-middleware target per
	// size and store; [0] without --prefill.
	prefills     []int64
	prefillGiven bool
}

// benchRun is one measured run: one target, one mode, one round.
type benchRun struct {
	Target     string         `json:"target"`
	Store      string         `json:"store"`
	Middleware bool           `json:"middleware"`
	Mode       string         `json:"mode"`
	Round      int            `json:"round"`
	Requests   int            `json:"requests"`
	Seconds    float64        `json:"seconds"`
	Throughput float64        `json:"throughput"`
	Statuses   map[string]int `json:"statuses"` // "201": n; "error": transport failures
	Replayed   int            `json:"replayed"` // answers with Idempotent-Replayed: true
	FirstError string         `json:"first_error,omitempty"`
	// Prefill is how many live keys of other users the target's table
	// held (--prefill); ResetKeys how many keys of earlier runs were
	// deleted before this run so that it started from those alone.
	Prefill   int64 `json:"prefill,omitempty"`
	ResetKeys int64 `json:"reset_keys,omitempty"`
	// ByStatus gives the latency percentiles of each status's answers.
	ByStatus map[string]benchLatency `json:"by_status"`
	// Held counts the statuses of the requests held in the handler while
	// the run measured (inflight mode), answered after it.
	Held map[string]int `json:"held,omitempty"`

	latencies []time.Duration
	codes     []string // the status of each latency, as in Statuses
}

// benchLatency is the latency percentiles of a set of answers.
type benchLatency struct {
	Requests int     `json:"requests"`
	P50      float64 `json:"p50_ms"`
	P90      float64 `json:"p90_ms"`
	P99      float64 `json:"p99_ms"`
	Max      float64 `json:"max_ms"`
}

// benchPrefill is one target's --prefill: how many keys, how long it took
// and the table's size afterwards.
type benchPrefill struct {
	Store      string  `json:"store"`
	Keys       int64   `json:"keys"`
	Seconds    float64 `json:"seconds"`
	TableBytes int64   `json:"table_bytes"`
}

// benchRow is the runs of one target and mode over every round: their
// requests and statuses added up, the median of their throughputs, and
// the percentiles of all their latencies together.
type benchRow struct {
	Target     string         `json:"target"`
	Store      string         `json:"store"`
	Middleware bool           `json:"middleware"`
	Mode       string         `json:"mode"`
	Prefill    int64          `json:"prefill,omitempty"`
	Rounds     int            `json:"rounds"`
	Requests   int            `json:"requests"`
	Throughput float64        `json:"throughput"` // median of the rounds', req/s
	P50        float64        `json:"p50_ms"`
	P90        float64        `json:"p90_ms"`
	P99        float64        `json:"p99_ms"`
	Max        float64        `json:"max_ms"`
	Statuses   map[string]int `json:"statuses"`
	Replayed   int            `json:"replayed"`
	FirstError string         `json:"first_error,omitempty"`
	// ByStatus: the percentiles of each status's answers, all rounds
	// together (e.g. the 409s of duplicates mode apart from its 201s).
	ByStatus map[string]benchLatency `json:"by_status"`
}

// benchRatio is the median, over the rounds, of one throughput divided by
// another measured in the same round.
type benchRatio struct {
	Name    string    `json:"name"`
	Store   string    `json:"store"`
	Mode    string    `json:"mode"`
	Prefill int64     `json:"prefill,omitempty"`
	Median  float64   `json:"median"`
	Rounds  []float64 `json:"rounds"`
}

// benchReport is what --json prints.
type benchReport struct {
	Target      string         `json:"target"`
	Concurrency int            `json:"concurrency"`
	Duration    string         `json:"duration"`
	Users       int            `json:"users"`
	Rounds      int            `json:"rounds"`
	Prefills    []benchPrefill `json:"prefills,omitempty"`
	Rows        []benchRow     `json:"rows"`
	Ratios      []benchRatio   `json:"ratios"`
	Runs        []benchRun     `json:"runs"`
}

func (a *App) benchCmd(ctx context.Context, args []string) error {
	var o benchOptions
	var c Config
	var storeList, modeList, prefillList string
	flags := cli.NewFlagSet("orders bench", "Load test: sends POST requests at a fixed concurrency, as fast as they are answered, and prints throughput, latency percentiles (p50/p90/p99/max) and the count of each status per target and mode, then the ratios of throughputs measured in the same rounds (with the middleware ÷ without, per store and mode; redis ÷ postgres with the middleware). --target library serves, on a loopback listener in this process, a handler that INSERTs one row and answers 201 with about 200 bytes, on each --store, with and without idem.Middleware, alternating which goes first from round to round. --target serve loads POST /v1/orders of a running `orders serve` at --url with bearer tokens signed by --jwt-secret (else by the secret kept in a postgres:// --database-url, else by the one in --data-dir). Each run uses fresh keys; replay mode creates --keys keys first and then repeats them; duplicates mode sends each fresh key --copies times in a row, so that concurrent clients send it at once; inflight mode (library only) first sends --keys requests that the handler holds until the run ends, and then repeats their keys, which the middleware answers 409 while they are in flight. Besides each row's percentiles, the latencies of each status are given apart (e.g. the 409s of duplicates mode). --prefill N1,N2,… (library, postgres and redis) measures, per store, one with-middleware target per size, each table holding that many live keys of other users, inserted before the first round; the ratio \"N live keys ÷ empty table\" compares them in the same rounds (e.g. --prefill 0,5000000), the targets of a store taking turns at going first. To draw a --json report as a PNG (throughput and p99 per store, mode and target): go run ./cmd/internal/benchkit/cmd/benchchart -in report.json -out chart.png.", a.Getenv)
	flags.String(&o.target, "target", "ORDERS_BENCH_TARGET", "library", "library (in-process handler on each --store) or serve (a running orders serve at --url)")
	flags.String(&storeList, "store", "ORDERS_BENCH_STORE", "memory,sqlite", "library: comma-separated stores among memory, sqlite, postgres, redis (redis is redisfront in front of pgstore and needs --database-url too)")
	flags.String(&o.databaseURL, "database-url", "DATABASE_URL", "", "library: PostgreSQL for the postgres and redis stores; each target makes a schema of its own there and drops it at the end. serve: the service's PostgreSQL database, whose JWT secret signs the tokens when --jwt-secret is not given")
	flags.String(&o.redisURL, "redis-url", "REDIS_URL", "", "library: Redis for the redis store, redis://host:port; its keys go under a prefix of its own, deleted at the end")
	flags.String(&o.serveURL, "url", "ORDERS_BENCH_URL", "http://127.0.0.1:8080", "serve: base URL of the running orders serve")
	flags.String(&c.JWTSecret, "jwt-secret", "ORDERS_JWT_SECRET", "", "serve: the service's HS256 secret for bearer tokens (default: the one kept in a postgres:// --database-url, else in <data-dir>/jwt-secret)")
	flags.String(&c.DataDir, "data-dir", "ORDERS_DATA_DIR", "./data", "serve: directory holding the service's generated JWT secret, when --jwt-secret is not given")
	flags.String(&modeList, "mode", "ORDERS_BENCH_MODE", "create", "comma-separated modes among nokey (no Idempotency-Key), create (a fresh key per request), replay (keys created first, then repeated), duplicates (each fresh key sent --copies times at once), inflight (library: --keys requests held in the handler for the whole run, their keys repeated: 409 in flight; --duration under the 30s lease)")
	flags.String(&prefillList, "prefill", "ORDERS_BENCH_PREFILL", "", "library, postgres and redis stores: comma-separated numbers of live keys (completed, unexpired, of users other than the workload's) to insert into the with-middleware target's table before measuring, one target per number (e.g. 0,5000000: an empty table and 5M keys, side by side in every round); each run then first deletes the keys of earlier runs. Redis: the keys go into the PostgreSQL table under it, not into Redis")
	flags.Int(&o.concurrency, "concurrency", "ORDERS_BENCH_CONCURRENCY", 32, 1, 4096, "clients sending at once, each waiting for its answer before the next request")
	flags.Duration(&o.duration, "duration", "ORDERS_BENCH_DURATION", 10*time.Second, "how long each run sends requests")
	flags.Int(&o.users, "users", "ORDERS_BENCH_USERS", 1, 1, 100000, "users the requests are spread over (the keys' scopes; serve: one bearer token each)")
	flags.Int(&o.rounds, "rounds", "ORDERS_BENCH_ROUNDS", 1, 1, 1000, "rounds; in each, every target runs every mode once, in alternating order; ratios are the median over the rounds")
	flags.Int(&o.keys, "keys", "ORDERS_BENCH_KEYS", benchkit.DefaultKeys, 1, 1000000, "replay: keys created before each run and then repeated; inflight: keys held in the handler during each run")
	flags.Int(&o.copies, "copies", "ORDERS_BENCH_COPIES", benchkit.DefaultCopies, 2, 4096, "duplicates: how many times each key is sent")
	flags.Bool(&o.json, "json", "ORDERS_BENCH_JSON", false, "print the report as JSON (rows, ratios and every run) instead of tables")
	flags.Bool(&o.progress, "progress", "ORDERS_BENCH_PROGRESS", false, "show the progress line on stderr even when stderr is not a terminal")
	if err := a.parse(flags, args); err != nil {
		return err
	}
	if o.duration <= 0 {
		return cli.Usagef("orders bench: --duration must be positive")
	}
	for _, m := range benchSplit(modeList) {
		mode, err := benchkit.ParseMode(m)
		if err != nil {
			return cli.Usagef("orders bench: --mode: %v", err)
		}
		if !slices.Contains(o.modes, mode) {
			o.modes = append(o.modes, mode)
		}
	}
	if len(o.modes) == 0 {
		return cli.Usagef("orders bench: --mode is empty")
	}
	if slices.Contains(o.modes, benchkit.Inflight) {
		if o.target != "library" {
			return cli.Usagef("orders bench: --mode inflight needs --target library (only its handler can be held)")
		}
		// Past the lease the held keys would be taken over, and answered 201.
		if o.duration > benchInflightMaxDuration {
			return cli.Usagef("orders bench: --mode inflight needs --duration of at most %s (the key lease is %s)", benchInflightMaxDuration, idem.DefaultLease)
		}
	}
	for _, p := range benchSplit(prefillList) {
		n, err := strconv.ParseInt(strings.ReplaceAll(p, "_", ""), 10, 64)
		if err != nil || n < 0 {
			return cli.Usagef("orders bench: --prefill: %q is not a number of keys", p)
		}
		if !slices.Contains(o.prefills, n) {
			o.prefills = append(o.prefills, n)
		}
		o.prefillGiven = true
	}
	if o.prefillGiven {
		if o.target != "library" {
			return cli.Usagef("orders bench: --prefill needs --target library")
		}
		slices.Sort(o.prefills)
	} else {
		o.prefills = []int64{0}
	}
	var tokens map[string]string
	switch o.target {
	case "library":
		for _, s := range benchSplit(storeList) {
			if !slices.Contains(benchkit.Stores, s) {
				return cli.Usagef("orders bench: --store: unknown store %q (want memory, sqlite, postgres or redis)", s)
			}
			if !slices.Contains(o.stores, s) {
				o.stores = append(o.stores, s)
			}
		}
		if len(o.stores) == 0 {
			return cli.Usagef("orders bench: --store is empty")
		}
		// Report in the usual order whatever the order given.
		slices.SortFunc(o.stores, func(x, y string) int {
			return slices.Index(benchkit.Stores, x) - slices.Index(benchkit.Stores, y)
		})
		if (slices.Contains(o.stores, benchkit.Postgres) || slices.Contains(o.stores, benchkit.Redis)) && o.databaseURL == "" {
			return cli.Usagef("orders bench: --store postgres and redis need --database-url")
		}
		if slices.Contains(o.stores, benchkit.Redis) && o.redisURL == "" {
			return cli.Usagef("orders bench: --store redis needs --redis-url")
		}
		if o.prefillGiven && (slices.Contains(o.stores, benchkit.Memory) || slices.Contains(o.stores, benchkit.SQLite)) {
			return cli.Usagef("orders bench: --prefill applies to the postgres and redis stores only")
		}
	case "serve":
		u, err := url.Parse(o.serveURL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return cli.Usagef("orders bench: --url %q is not an http:// or https:// URL", o.serveURL)
		}
		// Without --jwt-secret: the secret kept in the service's PostgreSQL
		// database, as its instances read it, else the data dir's.
		c.DatabaseURL = o.databaseURL
		var secret []byte
		if c.secretInDatabase() {
			if secret, err = a.databaseSecret(ctx, &c); err != nil {
				return err
			}
		} else {
			if c.JWTSecret == "" {
				if _, err := os.Stat(filepath.Join(c.DataDir, "jwt-secret")); errors.Is(err, fs.ErrNotExist) {
					return cli.Usagef("orders bench: --target serve needs --jwt-secret, the service's postgres:// --database-url, or the --data-dir of the service (holding jwt-secret)")
				}
			}
			if secret, err = c.secret(); err != nil {
				return err
			}
		}
		tokens = map[string]string{}
		for _, u := range benchkit.NewWorkload(benchkit.Create, o.users).Users {
			tok, err := orders.IssueToken(secret, u, 24*time.Hour, time.Now())
			if err != nil {
				return err
			}
			tokens[u] = tok
		}
	default:
		return cli.Usagef("orders bench: --target must be library or serve, not %q", o.target)
	}
	if !o.progress {
		if f, ok := a.Stderr.(*os.File); ok {
			if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
				o.progress = true
			}
		}
	}

	rep, err := benchRunAll(ctx, &o, tokens, a.Stderr)
	if err != nil {
		return err
	}
	if o.json {
		enc := json.NewEncoder(a.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	benchPrintTables(a.Stdout, rep)
	return nil
}

func benchSplit(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// benchEndpoint is one thing to load: a URL, and what to call it.
type benchEndpoint struct {
	store      string
	middleware bool
	prefill    int64
	url        string
	body       []byte
	tgt        *benchkit.Target // library only
}

func (ep benchEndpoint) name() string {
	n := ep.store + " " + benchMW(ep.middleware)
	if ep.prefill > 0 {
		n += fmt.Sprintf(" (%d live keys)", ep.prefill)
	}
	return n
}

// benchRunAll runs every round and builds the report.
func benchRunAll(ctx context.Context, o *benchOptions, tokens map[string]string, stderr io.Writer) (_ *benchReport, err error) {
	rep := &benchReport{Target: o.target, Concurrency: o.concurrency, Duration: o.duration.String(), Users: o.users, Rounds: o.rounds}
	// groups holds the endpoints of each store: the bare handler, then
	// the middleware on a table of each --prefill size (one, empty,
	// without --prefill).
	var groups [][]benchEndpoint
	if o.target == "serve" {
		groups = [][]benchEndpoint{{{store: "serve", middleware: true, url: strings.TrimSuffix(o.serveURL, "/") + "/v1/orders", body: benchOrderBody}}}
	} else {
		var closers []func()
		defer func() {
			// Stop serving, then close the target, last made first.
			for i := len(closers) - 1; i >= 0; i-- {
				closers[i]()
			}
		}()
		for _, s := range o.stores {
			g := []benchEndpoint{{store: s}}
			for _, p := range o.prefills {
				g = append(g, benchEndpoint{store: s, middleware: true, prefill: p})
			}
			for i := range g {
				tgt, err := benchkit.New(ctx, benchkit.Config{Store: s, Middleware: g[i].middleware, DatabaseURL: o.databaseURL, RedisURL: o.redisURL})
				if err != nil {
					return nil, err
				}
				url, stop, err := benchListen(tgt.Handler())
				if err != nil {
					tgt.Close()
					return nil, err
				}
				closers = append(closers, func() { stop(); tgt.Close() })
				tgt.CloseIdle() // the migration's connections
				g[i].url, g[i].body, g[i].tgt = url+benchkit.Path, benchkit.LibraryBody, tgt
			}
			groups = append(groups, g)
		}
		for _, g := range groups {
			for _, ep := range g {
				if ep.prefill == 0 {
					continue
				}
				p, err := benchDoPrefill(ctx, o, ep, stderr)
				ep.tgt.CloseIdle()
				if err != nil {
					return nil, err
				}
				rep.Prefills = append(rep.Prefills, p)
			}
		}
	}
	total := 0
	for _, g := range groups {
		total += o.rounds * len(o.modes) * len(g)
	}
	var runs []benchRun
	done := 0
	for round := 1; round <= o.rounds; round++ {
		for _, mode := range o.modes {
			for _, g := range groups {
				// The endpoints of a store take turns at going first:
				// with two (bare and with middleware), they alternate.
				k := (round - 1) % len(g)
				order := append(slices.Clone(g[k:]), g[:k]...)
				for _, ep := range order {
					done++
					label := fmt.Sprintf("[%d/%d] round %d %s %s", done, total, round, ep.name(), mode)
					var reset int64
					if o.prefillGiven && ep.middleware {
						if reset, err = ep.tgt.ResetKeys(ctx, benchkit.NewWorkload(mode, o.users).Users); err != nil {
							return nil, err
						}
					}
					run, err := benchOne(ctx, o, ep, mode, tokens, label, stderr)
					if ep.tgt != nil {
						// Only the target being loaded holds
						// PostgreSQL connections: a server's
						// max_connections is shared.
						ep.tgt.CloseIdle()
					}
					if err != nil {
						return nil, err
					}
					run.Target, run.Round, run.Prefill, run.ResetKeys = o.target, round, ep.prefill, reset
					runs = append(runs, *run)
					if err := ctx.Err(); err != nil {
						return nil, err
					}
				}
			}
		}
	}
	rep.Runs = runs
	rep.Rows, rep.Ratios = benchSummarize(rep.Runs, o)
	return rep, nil
}

// benchDoPrefill inserts ep.prefill live keys into ep's table, showing
// its progress when o.progress is set.
func benchDoPrefill(ctx context.Context, o *benchOptions, ep benchEndpoint, stderr io.Writer) (benchPrefill, error) {
	start := time.Now()
	label := "prefill " + ep.name()
	var progress func(int64)
	if o.progress {
		progress = func(done int64) {
			el := time.Since(start).Seconds()
			fmt.Fprintf(stderr, "\r\033[K%s %s %d/%d keys, %.1fs, %.0f keys/s", label, benchBar(float64(done)/float64(ep.prefill)), done, ep.prefill, el, float64(done)/max(el, 1e-9))
		}
		fmt.Fprintf(stderr, "\r\033[K%s %s 0/%d keys", label, benchBar(0), ep.prefill)
	}
	if err := ep.tgt.Prefill(ctx, ep.prefill, progress); err != nil {
		return benchPrefill{}, err
	}
	p := benchPrefill{Store: ep.store, Keys: ep.prefill, Seconds: time.Since(start).Seconds()}
	var err error
	if p.TableBytes, err = ep.tgt.TableBytes(ctx); err != nil {
		return p, err
	}
	if o.progress {
		fmt.Fprintf(stderr, "\r\033[K%s: %d keys in %.1fs (with VACUUM ANALYZE), table and indexes %.2f GB\n", label, p.Keys, p.Seconds, float64(p.TableBytes)/1e9)
	}
	return p, nil
}

// benchBar draws frac (0..1) as a bar of 20 characters.
func benchBar(frac float64) string {
	const width = 20
	n := int(min(max(frac, 0), 1) * width)
	return "[" + strings.Repeat("#", n) + strings.Repeat(".", width-n) + "]"
}

// benchListen serves h on a loopback port of its own.
func benchListen(h http.Handler) (url string, stop func(), err error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	return "http://" + ln.Addr().String(), func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	}, nil
}

func benchMW(mw bool) string {
	if mw {
		return "with middleware"
	}
	return "bare"
}

// benchOne warms up (replay mode) or holds requests in the handler
// (inflight mode) and then loads ep for o.duration.
func benchOne(ctx context.Context, o *benchOptions, ep benchEndpoint, mode benchkit.Mode, tokens map[string]string, label string, stderr io.Writer) (_ *benchRun, err error) {
	w := benchkit.NewWorkload(mode, o.users)
	w.Keys, w.Copies, w.Body, w.Tokens = o.keys, o.copies, ep.body, tokens
	if err := benchWarmup(ctx, w, ep.url, o.concurrency); err != nil {
		return nil, fmt.Errorf("%s: warm-up: %w", ep.name(), err)
	}
	var held *benchHeld
	if reqs := w.Held(); len(reqs) > 0 {
		if ep.tgt == nil {
			return nil, fmt.Errorf("%s: mode %s holds requests in the handler: library target only", ep.name(), mode)
		}
		if held, err = benchHold(ctx, o, ep, w, reqs); err != nil {
			return nil, fmt.Errorf("%s: holding %d requests in the handler: %w", ep.name(), len(reqs), err)
		}
		defer func() {
			if held != nil { // not yet released: an error on the way
				_, _ = held.release() // the error on the way is the one returned
			}
		}()
	}
	atk := vegeta.NewAttacker(
		vegeta.Workers(uint64(o.concurrency)),
		vegeta.MaxWorkers(uint64(o.concurrency)), // a fixed number of clients
		vegeta.Connections(o.concurrency),
		vegeta.KeepAlive(true),
		vegeta.Timeout(30*time.Second),
		vegeta.Redirects(vegeta.NoFollow),
	)
	targeter := vegeta.Targeter(func(t *vegeta.Target) error {
		r := w.Next()
		t.Method, t.URL, t.Body, t.Header = http.MethodPost, ep.url, r.Body, w.Header(r)
		return nil
	})
	run := &benchRun{Store: ep.store, Middleware: ep.middleware, Mode: string(mode), Statuses: map[string]int{}}
	var count atomic.Int64
	stopProgress := func() {}
	start := time.Now()
	if o.progress {
		stopProgress = benchProgress(stderr, label, start, o.duration, &count)
	}
	stopped := context.AfterFunc(ctx, func() { atk.Stop() })
	// A zero ConstantPacer is an unbounded rate: each client sends its
	// next request as soon as it has its answer.
	for res := range atk.Attack(targeter, vegeta.ConstantPacer{}, o.duration, label) {
		run.Requests++
		count.Add(1)
		run.latencies = append(run.latencies, res.Latency)
		if res.Code == 0 {
			run.Statuses["error"]++
			run.codes = append(run.codes, "error")
			if run.FirstError == "" {
				run.FirstError = res.Error
			}
			continue
		}
		code := strconv.Itoa(int(res.Code))
		run.Statuses[code]++
		run.codes = append(run.codes, code)
		if benchkit.Replayed(res.Headers) {
			run.Replayed++
		}
		if res.Code >= 500 && run.FirstError == "" {
			run.FirstError = strings.TrimSpace(string(res.Body))
		}
	}
	el := time.Since(start)
	stopped()
	stopProgress()
	run.Seconds = el.Seconds()
	run.Throughput = float64(run.Requests) / max(el.Seconds(), 1e-9)
	run.ByStatus = benchByStatus(run.latencies, run.codes)
	if held != nil {
		h := held
		held = nil
		if run.Held, err = h.release(); err != nil {
			return nil, fmt.Errorf("%s: the held requests: %w", ep.name(), err)
		}
	}
	return run, nil
}

// benchHeld is the requests of one run held in the library target's
// handler: each sent by a goroutine of its own, which waits for its
// answer.
type benchHeld struct {
	gate     *benchkit.Gate
	wg       sync.WaitGroup
	mu       sync.Mutex
	statuses map[string]int
	first    error
}

// benchHold opens a gate on ep's target, sends reqs and waits until the
// handler holds every one of them. The gate lets them go at the latest
// o.duration + 30s later; release lets them go at once.
func benchHold(ctx context.Context, o *benchOptions, ep benchEndpoint, w *benchkit.Workload, reqs []benchkit.Request) (*benchHeld, error) {
	bound := o.duration + 30*time.Second
	h := &benchHeld{gate: ep.tgt.Hold(bound), statuses: map[string]int{}}
	client := &http.Client{Timeout: bound + 30*time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: len(reqs)}}
	for _, r := range reqs {
		h.wg.Add(1)
		go func() {
			defer h.wg.Done()
			status, err := benchSendStatus(ctx, client, w, ep.url, r)
			h.mu.Lock()
			defer h.mu.Unlock()
			if err != nil {
				status = "error"
				if h.first == nil {
					h.first = err
				}
			}
			h.statuses[status]++
		}()
	}
	go func() {
		h.wg.Wait()
		client.CloseIdleConnections()
	}()
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := h.gate.WaitEntered(wctx, int64(len(reqs))); err != nil {
		_, _ = h.release() // the wait's error is the one returned
		return nil, fmt.Errorf("%d of %d held after 30s: %w", h.gate.Entered(), len(reqs), err)
	}
	return h, nil
}

// release lets the held requests go and waits for their answers and for
// the handler to let go of each (bounded: the client's timeout).
func (h *benchHeld) release() (map[string]int, error) {
	h.gate.Release()
	h.wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := h.gate.WaitEmpty(ctx); err != nil {
		return h.statuses, fmt.Errorf("%d still in the handler: %w", h.gate.Inside(), err)
	}
	return h.statuses, h.first
}

// benchSendStatus sends r and returns the status of its answer.
func benchSendStatus(ctx context.Context, client *http.Client, w *benchkit.Workload, url string, r benchkit.Request) (string, error) {
	req, err := w.HTTP(url, r)
	if err != nil {
		return "", err
	}
	resp, err := client.Do(req.WithContext(ctx))
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	return strconv.Itoa(resp.StatusCode), nil
}

// benchByStatus returns the latency percentiles of each status.
func benchByStatus(lat []time.Duration, codes []string) map[string]benchLatency {
	by := map[string][]time.Duration{}
	for i, c := range codes {
		by[c] = append(by[c], lat[i])
	}
	out := make(map[string]benchLatency, len(by))
	for c, l := range by {
		slices.Sort(l)
		out[c] = benchLatency{
			Requests: len(l),
			P50:      benchMS(benchPercentile(l, 0.50)),
			P90:      benchMS(benchPercentile(l, 0.90)),
			P99:      benchMS(benchPercentile(l, 0.99)),
			Max:      benchMS(l[len(l)-1]),
		}
	}
	return out
}

// benchWarmup sends w's warm-up requests, concurrency at a time, and
// wants each to succeed.
func benchWarmup(ctx context.Context, w *benchkit.Workload, url string, concurrency int) error {
	reqs := w.Warmup()
	if len(reqs) == 0 {
		return nil
	}
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: concurrency}}
	defer client.CloseIdleConnections()
	var next atomic.Int64
	var mu sync.Mutex
	var first error
	var wg sync.WaitGroup
	for range min(concurrency, len(reqs)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= len(reqs) || ctx.Err() != nil {
					return
				}
				err := benchSend(ctx, client, w, url, reqs[i])
				if err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	if first == nil {
		first = ctx.Err()
	}
	return first
}

func benchSend(ctx context.Context, client *http.Client, w *benchkit.Workload, url string, r benchkit.Request) error {
	req, err := w.HTTP(url, r)
	if err != nil {
		return err
	}
	resp, err := client.Do(req.WithContext(ctx))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("key %s: %s: %s", r.Key, resp.Status, strings.TrimSpace(string(b)))
	}
	return nil
}

// benchProgress rewrites one line on w every 200ms until stopped.
func benchProgress(w io.Writer, label string, start time.Time, d time.Duration, count *atomic.Int64) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(200 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-done:
				fmt.Fprintf(w, "\r\033[K")
				return
			case <-t.C:
				el := time.Since(start)
				n := count.Load()
				frac := min(el.Seconds()/d.Seconds(), 1)
				const width = 20
				bar := strings.Repeat("#", int(frac*width)) + strings.Repeat(".", width-int(frac*width))
				fmt.Fprintf(w, "\r\033[K%s [%s] %4.1fs/%s %d requests, %.0f req/s", label, bar, el.Seconds(), d, n, float64(n)/max(el.Seconds(), 1e-9))
			}
		}
	}()
	return func() {
		close(done)
		wg.Wait()
	}
}

func benchMedian(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// benchPercentile returns the q-quantile (nearest rank) of sorted.
func benchPercentile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(q*float64(len(sorted))+0.999999) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func benchMS(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

type benchKey struct {
	store   string
	mw      bool
	mode    string
	prefill int64
}

// benchSummarize builds the rows (in the order the runs first appear) and
// the ratios.
func benchSummarize(runs []benchRun, o *benchOptions) ([]benchRow, []benchRatio) {
	var keys []benchKey
	by := map[benchKey][]*benchRun{}
	for i := range runs {
		r := &runs[i]
		k := benchKey{r.Store, r.Middleware, r.Mode, r.Prefill}
		if _, ok := by[k]; !ok {
			keys = append(keys, k)
		}
		by[k] = append(by[k], r)
	}
	slices.SortStableFunc(keys, func(x, y benchKey) int {
		if c := slices.Index(benchkit.Stores, x.store) - slices.Index(benchkit.Stores, y.store); c != 0 {
			return c
		}
		if c := slices.Index(benchkit.Modes, benchkit.Mode(x.mode)) - slices.Index(benchkit.Modes, benchkit.Mode(y.mode)); c != 0 {
			return c
		}
		if x.mw != y.mw {
			if !x.mw {
				return -1
			}
			return 1
		}
		return cmp.Compare(x.prefill, y.prefill)
	})
	var rows []benchRow
	for _, k := range keys {
		rs := by[k]
		row := benchRow{Target: rs[0].Target, Store: k.store, Middleware: k.mw, Mode: k.mode, Prefill: k.prefill, Rounds: len(rs), Statuses: map[string]int{}}
		var lat []time.Duration
		var codes []string
		var tput []float64
		for _, r := range rs {
			row.Requests += r.Requests
			row.Replayed += r.Replayed
			for s, n := range r.Statuses {
				row.Statuses[s] += n
			}
			if row.FirstError == "" {
				row.FirstError = r.FirstError
			}
			lat = append(lat, r.latencies...)
			codes = append(codes, r.codes...)
			tput = append(tput, r.Throughput)
		}
		row.ByStatus = benchByStatus(lat, codes)
		slices.Sort(lat)
		row.Throughput = benchMedian(tput)
		row.P50 = benchMS(benchPercentile(lat, 0.50))
		row.P90 = benchMS(benchPercentile(lat, 0.90))
		row.P99 = benchMS(benchPercentile(lat, 0.99))
		if len(lat) > 0 {
			row.Max = benchMS(lat[len(lat)-1])
		}
		rows = append(rows, row)
	}
	// tput returns the throughput of each round of one target and mode.
	tput := func(k benchKey) map[int]float64 {
		m := map[int]float64{}
		for _, r := range by[k] {
			m[r.Round] = r.Throughput
		}
		return m
	}
	ratio := func(name, store, mode string, prefill int64, num, den map[int]float64) (benchRatio, bool) {
		br := benchRatio{Name: name, Store: store, Mode: mode, Prefill: prefill}
		for round := 1; round <= o.rounds; round++ {
			n, ok1 := num[round]
			d, ok2 := den[round]
			if ok1 && ok2 && d > 0 {
				br.Rounds = append(br.Rounds, n/d)
			}
		}
		br.Median = benchMedian(br.Rounds)
		return br, len(br.Rounds) > 0
	}
	var ratios []benchRatio
	add := func(r benchRatio, ok bool) {
		if ok {
			ratios = append(ratios, r)
		}
	}
	for _, s := range o.stores {
		for _, m := range o.modes {
			mode := string(m)
			for _, p := range o.prefills {
				add(ratio("with middleware ÷ without", s, mode, p, tput(benchKey{s, true, mode, p}), tput(benchKey{s, false, mode, 0})))
			}
			if slices.Contains(o.prefills, 0) {
				for _, p := range o.prefills {
					if p > 0 {
						add(ratio(fmt.Sprintf("%d live keys ÷ empty table, with middleware", p), s, mode, p, tput(benchKey{s, true, mode, p}), tput(benchKey{s, true, mode, 0})))
					}
				}
			}
		}
	}
	if slices.Contains(o.stores, benchkit.Redis) && slices.Contains(o.stores, benchkit.Postgres) {
		for _, m := range o.modes {
			for _, p := range o.prefills {
				add(ratio("redis ÷ postgres, with middleware", "redis/postgres", string(m), p, tput(benchKey{benchkit.Redis, true, string(m), p}), tput(benchKey{benchkit.Postgres, true, string(m), p})))
			}
		}
	}
	return rows, ratios
}

// benchStatusText renders statuses as "201:123 409:4 error:1", by code.
func benchStatusText(st map[string]int) string {
	ks := make([]string, 0, len(st))
	for k := range st {
		ks = append(ks, k)
	}
	sort.Strings(ks) // "error" sorts after the codes
	parts := make([]string, len(ks))
	for i, k := range ks {
		parts[i] = fmt.Sprintf("%s:%d", k, st[k])
	}
	return strings.Join(parts, " ")
}

func benchPrintTables(w io.Writer, rep *benchReport) {
	fmt.Fprintf(w, "orders bench: target %s, %d clients, %s per run, %d user(s), %d round(s)\n\n", rep.Target, rep.Concurrency, rep.Duration, rep.Users, rep.Rounds)
	if len(rep.Prefills) > 0 {
		fmt.Fprintln(w, "prefilled before the first round (live keys of other users; each run first deleted the keys of earlier runs):")
		for _, p := range rep.Prefills {
			fmt.Fprintf(w, "  %s with middleware: %d keys in %.1fs, table and indexes %.2f GB\n", p.Store, p.Keys, p.Seconds, float64(p.TableBytes)/1e9)
		}
		fmt.Fprintln(w)
	}
	// The column of live keys only where there is a --prefill.
	prefilled := false
	for _, r := range rep.Runs {
		prefilled = prefilled || r.Prefill > 0
	}
	live := func(r benchRow) string {
		if !prefilled {
			return ""
		}
		if !r.Middleware {
			return "-\t"
		}
		return strconv.FormatInt(r.Prefill, 10) + "\t"
	}
	liveHead := ""
	if prefilled {
		liveHead = "live keys\t"
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "target\tstore\tmiddleware\t"+liveHead+"mode\trequests\treq/s\tp50 ms\tp90 ms\tp99 ms\tmax ms\treplayed\t")
	for _, r := range rep.Rows {
		mw := "no"
		if r.Middleware {
			mw = "yes"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s%s\t%d\t%.0f\t%.2f\t%.2f\t%.2f\t%.2f\t%d\t\n", r.Target, r.Store, mw, live(r), r.Mode, r.Requests, r.Throughput, r.P50, r.P90, r.P99, r.Max, r.Replayed)
	}
	tw.Flush()
	// Latency by status, for the rows whose answers are not all 201.
	var mixed []benchRow
	for _, r := range rep.Rows {
		if _, ok := r.Statuses["201"]; !ok || len(r.Statuses) > 1 {
			mixed = append(mixed, r)
		}
	}
	if len(mixed) > 0 {
		fmt.Fprintln(w, "\nlatency by status (rows whose answers are not all 201):")
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "store\tmiddleware\t"+liveHead+"mode\tstatus\trequests\tp50 ms\tp90 ms\tp99 ms\tmax ms\t")
		for _, r := range mixed {
			mw := "no"
			if r.Middleware {
				mw = "yes"
			}
			codes := slices.Sorted(maps.Keys(r.ByStatus))
			for _, c := range codes {
				l := r.ByStatus[c]
				fmt.Fprintf(tw, "%s\t%s\t%s%s\t%s\t%d\t%.2f\t%.2f\t%.2f\t%.2f\t\n", r.Store, mw, live(r), r.Mode, c, l.Requests, l.P50, l.P90, l.P99, l.Max)
			}
		}
		tw.Flush()
	}
	fmt.Fprintln(w, "\nstatuses:")
	for _, r := range rep.Rows {
		mw := "bare"
		if r.Middleware {
			mw = "with middleware"
		}
		if r.Prefill > 0 {
			mw += fmt.Sprintf(" (%d live keys)", r.Prefill)
		}
		fmt.Fprintf(w, "  %s %s %s: %s\n", r.Store, mw, r.Mode, benchStatusText(r.Statuses))
		if r.FirstError != "" {
			fmt.Fprintf(w, "    first error: %.200s\n", r.FirstError)
		}
	}
	if len(rep.Ratios) > 0 {
		fmt.Fprintln(w, "\nratios of throughput (median of the rounds; each round's in brackets):")
		for _, r := range rep.Ratios {
			rs := make([]string, len(r.Rounds))
			for i, v := range r.Rounds {
				rs[i] = fmt.Sprintf("%.2f", v)
			}
			name := r.Name
			if r.Prefill > 0 && !strings.HasPrefix(name, strconv.FormatInt(r.Prefill, 10)+" ") {
				name += fmt.Sprintf(" (%d live keys)", r.Prefill)
			}
			fmt.Fprintf(w, "  %s %s: %s: %.2f [%s]\n", r.Store, r.Mode, name, r.Median, strings.Join(rs, " "))
		}
	}
}
