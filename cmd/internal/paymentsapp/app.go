// Package paymentsapp is the `payments` command: `payments serve` runs the
// payment gateway of package payments, with its flags and environment
// variables read by cmd/internal/cli as the `orders` command's are.
package paymentsapp

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

// Exit codes of Run.
const (
	ExitOK      = 0
	ExitFailure = 1
	ExitUsage   = cli.ExitUsage // unknown flags and bad values
)

// App runs the payments command. Getenv, Stdout and Stderr left nil take
// the process's own.
type App struct {
	Args   []string // the command line without the program name (Main: os.Args[1:])
	Getenv func(string) string
	Stdout io.Writer
	Stderr io.Writer
}

// Main runs the command line of the process until ctx ends and returns
// its exit code.
func Main(ctx context.Context) int { return (&App{Args: os.Args[1:]}).Run(ctx) }

const commandUsage = `payments: a payment gateway that speaks a Stripe-compatible subset of the
PaymentIntents and Refunds APIs, with fault injection for tests.

Usage:
  payments serve [flags]   run the gateway's HTTP API

Run 'payments serve --help' for the flags.
`

// Run runs the command until it is done or ctx ends, and returns its exit
// code: ExitOK, ExitFailure, or ExitUsage for unknown flags and bad values
// (with a one-line error). Flags are also read from environment variables;
// a flag wins over its variable.
func (a *App) Run(ctx context.Context) int {
	args := a.Args
	if a.Getenv == nil {
		a.Getenv = os.Getenv
	}
	if a.Stdout == nil {
		a.Stdout = os.Stdout
	}
	if a.Stderr == nil {
		a.Stderr = os.Stderr
	}
	if len(args) == 0 {
		fmt.Fprintln(a.Stderr, "payments: missing command, such as serve (try 'payments --help')")
		return ExitUsage
	}
	switch args[0] {
	case "serve":
		err := a.serve(ctx, args[1:])
		var ue *cli.UsageError
		switch {
		case err == nil, errors.Is(err, flag.ErrHelp):
			return ExitOK
		case errors.As(err, &ue):
			fmt.Fprintln(a.Stderr, oneLine(ue))
			return ExitUsage
		default:
			fmt.Fprintf(a.Stderr, "payments serve: %s\n", oneLine(err))
			return ExitFailure
		}
	case "help", "-h", "-help", "--help":
		fmt.Fprint(a.Stdout, commandUsage)
		return ExitOK
	default:
		fmt.Fprintf(a.Stderr, "payments: unknown command %q (try 'payments --help')\n", args[0])
		return ExitUsage
	}
}

// oneLine returns err's message on one line: pgx spreads some over
// several.
func oneLine(err error) string {
	return strings.Join(strings.Fields(err.Error()), " ")
}
