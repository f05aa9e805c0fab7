package ordersapp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/benchkit"
	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/orders"
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
