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
	"strconv"
	"strings"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
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
PaymentIntents API, with fault injection for tests.

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
			fmt.Fprintf(stderr, "payments serve: %v\n", err)
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

// serveConfig is what `payments serve` is given.
type serveConfig struct {
	addr            string
	databaseURL     string
	apiKey          string
	latency         time.Duration
	failAfterCharge float64
	declineOver     int64
}

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
		usage: "PostgreSQL URL for the ledger and the idempotency keys (not built yet)",
		set:   func(c *serveConfig, v string) error { c.databaseURL = v; return nil },
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
variable; the flag wins.

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
	for _, o := range serveOptions {
		fs.Func(o.name, o.usage, func(v string) error { return o.set(&c, v) })
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return c, err
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
	if c.databaseURL != "" {
		return c, errors.New("--database-url (PAYMENTS_DATABASE_URL): the PostgreSQL ledger is not built yet; leave it unset to keep PaymentIntents in memory")
	}
	return c, nil
}

// serve runs the gateway until ctx ends, then shuts it down gracefully.
func serve(ctx context.Context, c serveConfig, logw io.Writer) error {
	logger := slog.New(slog.NewTextHandler(logw, nil))
	store := memstore.New(memstore.Options{})
	gw := NewServer(Config{
		APIKey:          c.apiKey,
		Store:           store,
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
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
		BaseContext:       func(net.Listener) context.Context { return context.WithoutCancel(ctx) },
	}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	go sweep(ctx, store, logger)
	logger.Info("payments: listening", "url", "http://"+ln.Addr().String(), "latency", c.latency, "fail_after_charge", c.failAfterCharge, "decline_over", c.declineOver)

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

// sweep deletes expired idempotency keys now and then, until ctx ends.
func sweep(ctx context.Context, s idem.Sweeper, logger *slog.Logger) {
	t := time.NewTicker(time.Minute)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for {
			n, err := s.DeleteExpired(ctx, 1000)
			if err != nil {
				logger.Warn("payments: deleting expired keys", "err", err)
				break
			}
			if n < 1000 {
				break
			}
		}
	}
}
