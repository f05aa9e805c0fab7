// Package ordersapp is the `orders` command: the order service and its
// operator tools, wired from the library and the order domain.
package ordersapp

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/idem-go/idem/cmd/internal/cli"
)

// App runs the orders command. Fields left zero take the process's own.
type App struct {
	Stdout io.Writer
	Stderr io.Writer
	Getenv func(string) string
}

type command struct {
	name, summary string
	run           func(a *App, ctx context.Context, args []string) error
}

var commands = []command{
	{"serve", "run the HTTP API (migrates the schema first)", (*App).serve},
	{"migrate", "create or upgrade the schema and exit", (*App).migrate},
	{"token", "print a bearer token for a user", (*App).token},
	{"gc", "delete expired idempotency keys once, in batches", (*App).gc},
	{"audit", "check the invariants against the database and the gateway; exit 1 on a violation", (*App).audit},
	{"keys", "show, list, re-drive or purge idempotency keys (keys show|list|redrive|purge)", (*App).keys},
	{"demo", "run a retry storm against an in-process server and print what it created", (*App).demo},
	{"consume", "run the receipts consumer alone: apply each orders.created event once", (*App).consume},
	{"bench", "load test: the library alone in-process, or a running serve; throughput, latency, statuses", (*App).benchCmd},
}

// Run runs the command line args (without the program name) and returns
// the exit status: 0, 1 for a failure, 2 for a usage error.
func (a *App) Run(ctx context.Context, args []string) int {
	if a.Stdout == nil {
		a.Stdout = os.Stdout
	}
	if a.Stderr == nil {
		a.Stderr = os.Stderr
	}
	if a.Getenv == nil {
		a.Getenv = os.Getenv
	}
	if len(args) == 0 {
		a.usage(a.Stderr)
		return cli.ExitUsage
	}
	switch args[0] {
	case "-h", "--help", "-help", "help":
		a.usage(a.Stdout)
		return 0
	}
	for _, c := range commands {
		if c.name != args[0] {
			continue
		}
		err := c.run(a, ctx, args[1:])
		var ue *cli.UsageError
		switch {
		case err == nil:
			return 0
		case errors.Is(err, flag.ErrHelp):
			return 0
		case errors.As(err, &ue):
			fmt.Fprintln(a.Stderr, ue.Msg)
			return cli.ExitUsage
		default:
			fmt.Fprintf(a.Stderr, "orders %s: %s\n", c.name, oneLine(err.Error()))
			return 1
		}
	}
	fmt.Fprintf(a.Stderr, "orders: unknown command %q (see orders --help)\n", args[0])
	return cli.ExitUsage
}

func (a *App) usage(w io.Writer) {
	var b strings.Builder
	b.WriteString("Usage: orders <command> [flags]\n\nAn order API whose POST /v1/orders is idempotent: retries and racing\nduplicates never create a second order or a second charge.\n\nCommands:\n")
	for _, c := range commands {
		fmt.Fprintf(&b, "  %-8s %s\n", c.name, c.summary)
	}
	b.WriteString("\nRun `orders <command> --help` for its flags and environment variables.\n")
	io.WriteString(w, b.String())
}

// parse parses args with fs, printing --help to stdout.
func (a *App) parse(fs *cli.FlagSet, args []string) error {
	err := fs.Parse(args)
	if errors.Is(err, flag.ErrHelp) {
		fs.PrintUsage(a.Stdout)
	}
	return err
}

// oneLine joins the lines of an error message (pgconn's connect error
// gives each address tried a line of its own) into one: a line that ends
// with ':' is followed by a space, any other by "; ".
func oneLine(msg string) string {
	if !strings.ContainsAny(msg, "\r\n") {
		return msg
	}
	var b strings.Builder
	for _, l := range strings.FieldsFunc(msg, func(r rune) bool { return r == '\n' || r == '\r' }) {
		l = strings.TrimSpace(l)
		if l == "" {
			continue
		}
		if b.Len() > 0 {
			if strings.HasSuffix(b.String(), ":") {
				b.WriteString(" ")
			} else {
				b.WriteString("; ")
			}
		}
		b.WriteString(l)
	}
	return b.String()
}
