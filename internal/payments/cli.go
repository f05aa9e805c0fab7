package payments

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Exit codes of RunCLI.
const (
	ExitOK      = 0
	ExitFailure = 1
	ExitUsage   = 2
)

// RunCLI runs the payments command with args (the program name left out)
// until it is done or ctx ends, and returns its exit code: ExitOK,
// ExitFailure, or ExitUsage for unknown flags and bad values. Flags are
// also read from environment variables; a flag wins over its variable.
func RunCLI(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return runCLI(ctx, args, os.Getenv, stdout, stderr)
}

const commandUsage = `payments: a payment gateway that speaks a Stripe-compatible subset of the
PaymentIntents and Refunds APIs, with fault injection for tests.

Usage:
  payments serve [flags]   run the gateway's HTTP API

Run 'payments serve --help' for the flags.
`

func runCLI(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "payments: missing command, such as serve (try 'payments --help')")
		return ExitUsage
	}
	switch args[0] {
	case "serve":
		cfg, err := parseServe(args[1:], getenv)
		switch {
		case errors.Is(err, flag.ErrHelp):
			fmt.Fprint(stdout, serveUsage())
			return ExitOK
		case err != nil:
			fmt.Fprintf(stderr, "payments serve: %v\n", err)
			return ExitUsage
		}
		if err := serve(ctx, cfg, stderr); err != nil {
			fmt.Fprintf(stderr, "payments serve: %s\n", oneLine(err))
			return ExitFailure
		}
		return ExitOK
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, commandUsage)
		return ExitOK
	default:
		fmt.Fprintf(stderr, "payments: unknown command %q (try 'payments --help')\n", args[0])
		return ExitUsage
	}
}

// oneLine returns err's message on one line: pgx spreads some over
// several.
func oneLine(err error) string {
	return strings.Join(strings.Fields(err.Error()), " ")
}

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
// idempotency keys, in batches of DefaultCleanBatch.
const defaultCleanEvery = time.Minute

// serveOption is one flag of `payments serve` and its environment variable.
type serveOption struct {
	name, env, arg, usage string
	def                   string // as --help shows it
	set                   func(c *serveConfig, v string) error
}

var serveOptions = []serveOption{
	{
		name: "addr", env: "PAYMENTS_ADDR", arg: "host:port", def: "127.0.0.1:8081",
		usage: "address to listen on",
		set: func(c *serveConfig, v string) error {
			if _, _, err := net.SplitHostPort(v); err != nil {
				return fmt.Errorf("not a host:port: %q", v)
			}
			c.addr = v
			return nil
		},
	},
	{
		name: "database-url", env: "PAYMENTS_DATABASE_URL", arg: "url", def: "in memory",
		usage: "where the PaymentIntents and the idempotency keys are kept, so that they\n" +
			"      survive a restart (tables are created or upgraded at start):\n" +
			"        postgres://… or postgresql://…  PostgreSQL; the tables go in the schema\n" +
			"          that the URL's search_path names (…?search_path=payments, created\n" +
			"          if missing), else in the server's default (public)\n" +
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
		name: "api-key", env: "PAYMENTS_API_KEY", arg: "key", def: "unset: any sk_test_… key",
		usage: "the only secret key accepted",
		set:   func(c *serveConfig, v string) error { c.apiKey = v; return nil },
	},
	{
		name: "latency", env: "PAYMENTS_LATENCY", arg: "duration", def: "0",
		usage: "added before each charge is made",
		set: func(c *serveConfig, v string) error {
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 {
				return fmt.Errorf("not a duration ≥ 0 such as 250ms: %q", v)
			}
			c.latency = d
			return nil
		},
	},
	{
		name: "fail-after-charge", env: "PAYMENTS_FAIL_AFTER_CHARGE", arg: "fraction", def: "0",
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
		name: "decline-over", env: "PAYMENTS_DECLINE_OVER", arg: "amount", def: "0",
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

func serveUsage() string {
	var b strings.Builder
	b.WriteString(`Usage: payments serve [flags]

Runs the gateway's HTTP API. Every flag can also be set by its environment
variable; the flag wins. Idempotency keys are kept for 24 hours, as at
Stripe; a cleaner deletes expired ones every minute. Slow or greedy
clients are cut: headers must arrive within 10s and the whole request
within 30s (--latency and a slow charge may run longer), request headers
are bounded to 64 KiB (431 over it), idle connections close after 2m.

Flags:
`)
	for _, o := range serveOptions {
		fmt.Fprintf(&b, "  --%s %s\n      %s\n      (env %s, default %s)\n", o.name, o.arg, o.usage, o.env, o.def)
	}
	b.WriteString("  --help\n      show this help\n")
	return b.String()
}

// parseServe reads the flags of `payments serve`, then the environment for
// the flags not given. It returns flag.ErrHelp for --help.
func parseServe(args []string, getenv func(string) string) (serveConfig, error) {
	c := serveConfig{addr: "127.0.0.1:8081"}
	fs := flag.NewFlagSet("payments serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	var dbErr error // the database URL's, reported without the URL, which may hold a password
	for _, o := range serveOptions {
		fs.Func(o.name, o.usage, func(v string) error {
			err := o.set(&c, v)
			if o.name == "database-url" {
				dbErr = err
			}
			return err
		})
	}
	if err := fs.Parse(args); err != nil {
		switch {
		case errors.Is(err, flag.ErrHelp):
			return c, err
		case dbErr != nil:
			return c, fmt.Errorf("invalid value for flag --database-url: %v", dbErr)
		}
		return c, errors.New(strings.Replace(err.Error(), " -", " --", 1))
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, o := range serveOptions {
		if given[o.name] {
			continue
		}
		if v := getenv(o.env); v != "" {
			if err := o.set(&c, v); err != nil {
				return c, fmt.Errorf("invalid value for %s: %v", o.env, err)
			}
		}
	}
	return c, nil
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
	ledger Ledger // nil: the default MemLedger
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
		st, l, err := OpenSQLite(ctx, path)
		if err != nil {
			return nil, err
		}
		return &backend{name: "sqlite:" + path, store: st, ledger: l, close: func() { st.Close() }}, nil
	default:
		pool, err := PostgresPool(ctx, u, urlSchema(u))
		if err != nil {
			return nil, err
		}
		st, l, err := OpenPostgres(ctx, pool)
		if err != nil {
			pool.Close()
			return nil, err
		}
		return &backend{name: "postgres", store: st, ledger: l, close: pool.Close}, nil
	}
}

// plainSchema is a schema name that needs no quoting.
var plainSchema = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

// urlSchema returns the schema that a PostgreSQL URL's search_path names,
// when it names just one, plainly: serve creates it if it is missing.
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

// serve runs the gateway until ctx ends, then shuts it down gracefully.
func serve(ctx context.Context, c serveConfig, logw io.Writer) error {
	logger := slog.New(slog.NewTextHandler(logw, nil))
	be, err := openBackend(ctx, c.databaseURL)
	if err != nil {
		return err
	}
	defer be.close()
	gw := NewServer(Config{
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
	sweepCtx, stopSweep := context.WithCancel(ctx)
	swept := make(chan struct{})
	cleanEvery := c.cleanEvery
	if cleanEvery <= 0 {
		cleanEvery = defaultCleanEvery
	}
	go func() { defer close(swept); cleanLoop(sweepCtx, gw, cleanEvery, logger) }()
	defer func() { stopSweep(); <-swept }() // before the database closes
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

// cleanLoop deletes the gateway's expired idempotency keys at start and
// then every interval, in small batches (Server.CleanExpiredKeys), until
// ctx ends.
func cleanLoop(ctx context.Context, gw *Server, interval time.Duration, logger *slog.Logger) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		n, err := gw.CleanExpiredKeys(ctx, CleanOptions{})
		switch {
		case err != nil && ctx.Err() == nil:
			logger.Warn("payments: deleting expired idempotency keys", "err", err)
		case n > 0:
			logger.Info("payments: deleted expired idempotency keys", "count", n)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
