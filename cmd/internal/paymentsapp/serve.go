package paymentsapp

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/memstore"
)

// serveConfig is what `payments serve` is given.
type serveConfig struct {
	addr            string
	databaseURL     string
	apiKey          string
	latency         time.Duration
	failAfterCharge float64
	declineOver     int64
	// cleanEvery is how often the cleaner deletes expired idempotency
	// keys. Default defaultCleanEvery.
	cleanEvery time.Duration
}

// defaultCleanEvery is how often `payments serve` deletes expired
// idempotency keys, in batches of payments.DefaultCleanBatch.
const defaultCleanEvery = time.Minute

// serveOption is one flag of `payments serve` and its environment variable.
type serveOption struct {
	name, env, usage string
	def              string // as --help shows it
	secret           bool   // a refused value is not repeated: it may hold a password
	set              func(c *serveConfig, v string) error
}

var serveOptions = []serveOption{
	{
		name: "addr", env: "PAYMENTS_ADDR", def: "127.0.0.1:8081",
		usage: "address to listen on (host:port)",
		set: func(c *serveConfig, v string) error {
			if _, _, err := net.SplitHostPort(v); err != nil {
				return fmt.Errorf("not a host:port: %q", v)
			}
			c.addr = v
			return nil
		},
	},
	{
		name: "database-url", env: "PAYMENTS_DATABASE_URL", def: "in memory", secret: true,
		usage: "where the PaymentIntents and the idempotency keys are kept, so that they\n" +
			"      survive a restart (tables are created or upgraded at start):\n" +
			"        postgres://… or postgresql://…  PostgreSQL; the tables go in the schema\n" +
			"          that the URL's search_path names (…?search_path=payments, created\n" +
			"          if missing, named in every statement and not sent as a setting, so\n" +
			"          the URL may be PgBouncer's in transaction mode), else in the\n" +
			"          server's default (public)\n" +
			"        sqlite:PATH  a SQLite file of the gateway's own (created if missing)\n" +
			"      unset: in memory, forgotten when the gateway stops",
		set: func(c *serveConfig, v string) error {
			if err := checkDatabaseURL(v); err != nil {
				return err
			}
			c.databaseURL = v
			return nil
		},
	},
	{
		name: "api-key", env: "PAYMENTS_API_KEY", def: "unset: any sk_test_… key, on a loopback --addr only",
		usage: "the only secret key accepted; required when --addr is not a loopback address\n" +
			"      (else anyone who reaches the gateway could charge with a made-up sk_test_ key)",
		set: func(c *serveConfig, v string) error { c.apiKey = v; return nil },
	},
	{
		name: "latency", env: "PAYMENTS_LATENCY", def: "0",
		usage: "added before each charge is made (a duration, shorter than 12h: half the keys' 24h retention, the longest lease)",
		set: func(c *serveConfig, v string) error {
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 {
				return fmt.Errorf("not a duration ≥ 0 such as 250ms: %q", v)
			}
			if max := payments.MaxLatency(payments.DefaultKeyRetention); d >= max {
				return fmt.Errorf("%v is not shorter than %v: a charge must end within its key's lease, at most half the keys' %v retention", d, max, payments.DefaultKeyRetention)
			}
			c.latency = d
			return nil
		},
	},
	{
		name: "fail-after-charge", env: "PAYMENTS_FAIL_AFTER_CHARGE", def: "0",
		usage: "fraction 0..1 of first attempts that record the payment and then drop the connection without answering",
		set: func(c *serveConfig, v string) error {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || !(f >= 0 && f <= 1) {
				return fmt.Errorf("not a fraction within 0..1: %q", v)
			}
			c.failAfterCharge = f
			return nil
		},
	},
	{
		name: "decline-over", env: "PAYMENTS_DECLINE_OVER", def: "0",
		usage: "decline amounts above this, in minor units (0: no limit)",
		set: func(c *serveConfig, v string) error {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 0 {
				return fmt.Errorf("not an amount ≥ 0 in minor units: %q", v)
			}
			c.declineOver = n
			return nil
		},
	},
}

// serveSummary is what `payments serve --help` says before the flags.
const serveSummary = `Runs the gateway's HTTP API. Idempotency keys are kept for 24 hours, as at
Stripe; a cleaner deletes expired ones every minute. Slow or greedy
clients are cut: headers must arrive within 10s and the whole request
within 30s (--latency and a slow charge may run longer), request headers
are bounded to 64 KiB (431 over it), idle connections close after 2m.`

// serveFlags returns the flags of `payments serve`, which set c.
func serveFlags(c *serveConfig, getenv func(string) string) *cli.FlagSet {
	fs := cli.NewFlagSet("payments serve", serveSummary, getenv)
	for _, o := range serveOptions {
		fs.Func(o.name, o.env, o.def, o.usage, func(v string) error { return o.set(c, v) })
		if o.secret {
			fs.Secret(o.name)
		}
	}
	return fs
}

// parseServe reads the flags of `payments serve`, then the environment for
// the flags not given. It returns flag.ErrHelp for --help.
func parseServe(args []string, getenv func(string) string) (serveConfig, error) {
	c := serveConfig{addr: "127.0.0.1:8081"}
	err := serveFlags(&c, getenv).Parse(args)
	return c, err
}

// checkDatabaseURL reports whether v is a --database-url that serve can
// open, without echoing it: it may hold a password.
func checkDatabaseURL(v string) error {
	switch {
	case v == "":
		return nil
	case strings.HasPrefix(v, "postgres://"), strings.HasPrefix(v, "postgresql://"):
		if _, err := pgxpool.ParseConfig(v); err != nil {
			return errors.New("not a valid PostgreSQL URL")
		}
		return nil
	case strings.HasPrefix(v, "sqlite:"):
		if sqlitePath(v) == "" {
			return errors.New("sqlite: needs a file path, as in sqlite:/var/lib/payments.db")
		}
		return nil
	}
	return errors.New("want postgres://… or sqlite:PATH (unset keeps everything in memory)")
}

// sqlitePath returns the file of a sqlite: URL: sqlite:PATH or
// sqlite://PATH.
func sqlitePath(v string) string {
	return strings.TrimPrefix(strings.TrimPrefix(v, "sqlite:"), "//")
}

// backend is where a served gateway keeps its idempotency keys and its
// PaymentIntents.
type backend struct {
	name   string // for the log: memory, postgres or sqlite:PATH
	store  idem.Store
	ledger payments.Ledger // nil: the default MemLedger
	close  func()
}

// openTimeout bounds connecting to the database and migrating it.
const openTimeout = 30 * time.Second

// openBackend opens (and migrates) the database that u names; see
// checkDatabaseURL.
func openBackend(ctx context.Context, u string) (*backend, error) {
	ctx, cancel := context.WithTimeout(ctx, openTimeout)
	defer cancel()
	switch {
	case u == "":
		st := memstore.New(memstore.Options{})
		return &backend{name: "memory", store: st, close: func() {}}, nil
	case strings.HasPrefix(u, "sqlite:"):
		path := sqlitePath(u)
		if dir := filepath.Dir(path); dir != "." {
			if err := os.MkdirAll(dir, 0o700); err != nil {
				return nil, err
			}
		}
		st, l, err := payments.OpenSQLite(ctx, path)
		if err != nil {
			return nil, err
		}
		return &backend{name: "sqlite:" + path, store: st, ledger: l, close: func() { st.Close() }}, nil
	default:
		schema := urlSchema(u)
		pool, err := payments.PostgresPool(ctx, u, schema)
		if err != nil {
			return nil, err
		}
		st, l, err := payments.OpenPostgres(ctx, pool, schema)
		if err != nil {
			pool.Close()
			return nil, err
		}
		return &backend{name: "postgres", store: st, ledger: l, close: pool.Close}, nil
	}
}

// loopbackAddr reports whether the host of addr (host:port) is a loopback
// address or "localhost": nothing beyond this machine reaches it. An
// empty host (every interface) is not.
func loopbackAddr(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// plainSchema is a schema name that needs no quoting.
var plainSchema = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

// urlSchema returns the schema that a PostgreSQL URL's search_path names,
// when it names just one, plainly: serve creates it if it is missing, and
// names it in every statement instead of sending the URL's search_path,
// which PgBouncer in transaction mode refuses. Otherwise "": the URL's
// search_path, if any, is sent and selects the tables.
func urlSchema(u string) string {
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		return ""
	}
	sp := strings.TrimSpace(cfg.ConnConfig.RuntimeParams["search_path"])
	if !plainSchema.MatchString(sp) {
		return ""
	}
	return sp
}

// Bounds on what a client may make `payments serve` wait for or hold
// (issue 10, point 6), said in --help. No write deadline: it would cut a
// slow charge's answer (--latency).
const (
	serveReadHeaderTimeout = 10 * time.Second // the request's headers
	// serveReadTimeout bounds reading the whole request, headers and body;
	// a client that sends part of a form and stops is cut before the
	// handler runs. It bounds reading only: a charge still running after
	// it is answered.
	serveReadTimeout    = 30 * time.Second
	serveIdleTimeout    = 2 * time.Minute // an idle keep-alive connection
	serveMaxHeaderBytes = 64 << 10        // request line and headers; 431 over it
)

// serve parses args and runs the gateway until ctx ends, then shuts it
// down gracefully.
func (a *App) serve(ctx context.Context, args []string) error {
	c := serveConfig{addr: "127.0.0.1:8081"}
	fs := serveFlags(&c, a.Getenv)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fs.PrintUsage(a.Stdout)
		}
		return err
	}
	return run(ctx, c, slog.New(slog.NewTextHandler(a.Stderr, nil)))
}

// run serves c until ctx ends.
func run(ctx context.Context, c serveConfig, logger *slog.Logger) error {
	if c.apiKey == "" && !loopbackAddr(c.addr) {
		return cli.Usagef("payments serve: --addr %s is not a loopback address: give --api-key (PAYMENTS_API_KEY), "+
			"else anyone who reaches the gateway may charge with any sk_test_ key", c.addr)
	}
	be, err := openBackend(ctx, c.databaseURL)
	if err != nil {
		return err
	}
	defer be.close()
	gw := payments.NewServer(payments.Config{
		APIKey:          c.apiKey,
		Store:           be.store,
		Ledger:          be.ledger,
		Latency:         c.latency,
		FailAfterCharge: c.failAfterCharge,
		DeclineOver:     c.declineOver,
		Logger:          logger,
	})
	ln, err := net.Listen("tcp", c.addr)
	if err != nil {
		return err
	}
	hs := &http.Server{
		Handler:           gw,
		ReadHeaderTimeout: serveReadHeaderTimeout,
		ReadTimeout:       serveReadTimeout,
		IdleTimeout:       serveIdleTimeout,
		MaxHeaderBytes:    serveMaxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
		BaseContext:       func(net.Listener) context.Context { return context.WithoutCancel(ctx) },
	}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	// The cleaner deletes the gateway's expired keys at start and then
	// every cleanEvery; it stops before the database closes.
	cleanEvery := c.cleanEvery
	if cleanEvery <= 0 {
		cleanEvery = defaultCleanEvery
	}
	cleaner := gw.NewCleaner(idem.CleanerOptions{Interval: cleanEvery, Logger: logger})
	sweepCtx, stopSweep := context.WithCancel(ctx)
	swept := make(chan struct{})
	go func() { defer close(swept); cleaner.Run(sweepCtx) }()
	defer func() { stopSweep(); <-swept }()
	logger.Info("payments: listening", "url", "http://"+ln.Addr().String(), "backend", be.name, "latency", c.latency, "fail_after_charge", c.failAfterCharge, "decline_over", c.declineOver)

	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	logger.Info("payments: shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second+c.latency)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		hs.Close()
		return fmt.Errorf("shutdown: %w", err)
	}
	return nil
}
