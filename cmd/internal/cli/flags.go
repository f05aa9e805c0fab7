// Package cli holds what the commands share: flags that every command can
// also take from an environment variable (the flag wins), one-line usage
// errors with exit status 2, and --help that lists both.
package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"
)

// ExitUsage is the exit status for unknown flags and bad values.
const ExitUsage = 2

// UsageError is a mistake in the command line or the environment.
type UsageError struct{ Msg string }

func (e *UsageError) Error() string { return e.Msg }

// Usagef returns a *UsageError.
func Usagef(format string, args ...any) error { return &UsageError{Msg: fmt.Sprintf(format, args...)} }

// FlagSet is a flag.FlagSet whose flags may also come from the environment.
type FlagSet struct {
	fs      *flag.FlagSet
	command string
	summary string
	envs    map[string]string // flag name → env var
	secrets map[string]bool   // flags whose values are never shown in errors
	getenv  func(string) string
	// failed names the flag whose value was refused last: the value, and why.
	failed, failedVal string
	failedErr         error
}

// NewFlagSet returns a FlagSet for command ("orders serve") with a one-line
// summary for --help. getenv is os.Getenv when nil.
func NewFlagSet(command, summary string, getenv func(string) string) *FlagSet {
	if getenv == nil {
		getenv = os.Getenv
	}
	fs := flag.NewFlagSet(command, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return &FlagSet{fs: fs, command: command, summary: summary, envs: map[string]string{}, secrets: map[string]bool{}, getenv: getenv}
}

// Func defines a flag whose value set checks and keeps; def is the default
// that --help shows (empty: none).
func (f *FlagSet) Func(name, env, def, usage string, set func(string) error) {
	if def != "" {
		usage += " (default " + def + ")"
	}
	f.fs.Func(name, usage, f.checked(name, set))
	f.bind(name, env)
}

// Secret marks the flag name as holding a secret (a password, a URL that
// may hold one): a refused value is not repeated in the error.
func (f *FlagSet) Secret(name string) { f.secrets[name] = true }

// checked returns set, remembering which flag's value it refused.
func (f *FlagSet) checked(name string, set func(string) error) func(string) error {
	return func(v string) error {
		err := set(v)
		if err != nil {
			f.failed, f.failedVal, f.failedErr = name, v, err
		}
		return err
	}
}

// String defines a string flag.
func (f *FlagSet) String(p *string, name, env, def, usage string) {
	f.fs.StringVar(p, name, def, usage)
	f.bind(name, env)
}

// Bool defines a boolean flag.
func (f *FlagSet) Bool(p *bool, name, env string, def bool, usage string) {
	f.fs.BoolVar(p, name, def, usage)
	f.bind(name, env)
}

// Duration defines a duration flag ("30s", "24h"); negative values are refused.
func (f *FlagSet) Duration(p *time.Duration, name, env string, def time.Duration, usage string) {
	*p = def
	f.fs.Func(name, usage+" (default "+def.String()+")", f.checked(name, func(s string) error {
		d, err := time.ParseDuration(s)
		if err != nil {
			return errors.New("not a duration such as 500ms, 30s or 24h")
		}
		if d < 0 {
			return errors.New("must not be negative")
		}
		*p = d
		return nil
	}))
	f.bind(name, env)
}

// Int defines an integer flag with bounds.
func (f *FlagSet) Int(p *int, name, env string, def, lo, hi int, usage string) {
	*p = def
	f.fs.Func(name, fmt.Sprintf("%s (default %d)", usage, def), f.checked(name, func(s string) error {
		n, err := strconv.Atoi(s)
		if err != nil || n < lo || n > hi {
			return fmt.Errorf("must be an integer in %d..%d", lo, hi)
		}
		*p = n
		return nil
	}))
	f.bind(name, env)
}

// Float defines a float flag with bounds.
func (f *FlagSet) Float(p *float64, name, env string, def, lo, hi float64, usage string) {
	*p = def
	f.fs.Func(name, fmt.Sprintf("%s (default %g)", usage, def), f.checked(name, func(s string) error {
		v, err := strconv.ParseFloat(s, 64)
		if err != nil || v < lo || v > hi {
			return fmt.Errorf("must be a number in %g..%g", lo, hi)
		}
		*p = v
		return nil
	}))
	f.bind(name, env)
}

func (f *FlagSet) bind(name, env string) {
	if env != "" {
		f.envs[name] = env
	}
}

// Parse reads args, then the environment variables of the flags that args
// did not set: a flag wins over its variable, even over a bad value of it.
// It returns flag.ErrHelp for -h/--help and a *UsageError for anything else
// that is wrong. Errors name flags as --name, and do not repeat the value
// of a Secret flag.
func (f *FlagSet) Parse(args []string) error {
	f.failed, f.failedVal, f.failedErr = "", "", nil
	if err := f.fs.Parse(args); err != nil {
		switch {
		case errors.Is(err, flag.ErrHelp):
			return flag.ErrHelp
		case f.failed != "" && f.secrets[f.failed]:
			return Usagef("%s: invalid value for --%s: %v (see --help)", f.command, f.failed, unwrapFlagErr(f.failedErr))
		case f.failed != "":
			return Usagef("%s: invalid value %q for --%s: %v (see --help)", f.command, f.failedVal, f.failed, unwrapFlagErr(f.failedErr))
		}
		return Usagef("%s: %s (see --help)", f.command, strings.Replace(unwrapFlagErr(err), " -", " --", 1))
	}
	if f.fs.NArg() > 0 {
		return Usagef("%s: unexpected argument %q (see --help)", f.command, f.fs.Arg(0))
	}
	given := map[string]bool{}
	f.fs.Visit(func(fl *flag.Flag) { given[fl.Name] = true })
	names := make([]string, 0, len(f.envs))
	for n := range f.envs {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		env := f.envs[n]
		if given[n] {
			continue
		}
		if v, ok := lookup(f.getenv, env); ok {
			if err := f.fs.Set(n, v); err != nil {
				if f.secrets[n] {
					return Usagef("%s: invalid value for %s: %v", f.command, env, unwrapFlagErr(err))
				}
				return Usagef("%s: invalid value %q for %s: %v", f.command, v, env, unwrapFlagErr(err))
			}
		}
	}
	return nil
}

func lookup(getenv func(string) string, env string) (string, bool) {
	v := getenv(env)
	return v, v != ""
}

func unwrapFlagErr(err error) string {
	return strings.TrimSpace(err.Error())
}

// PrintUsage writes --help text: the summary, then every flag with its
// environment variable and default.
func (f *FlagSet) PrintUsage(w io.Writer) {
	fmt.Fprintf(w, "Usage: %s [flags]\n\n%s\n\nFlags (each may also be set by the environment variable shown; the flag wins):\n", f.command, f.summary)
	f.fs.VisitAll(func(fl *flag.Flag) {
		line := "  --" + fl.Name
		if env := f.envs[fl.Name]; env != "" {
			line += "  [$" + env + "]"
		}
		usage := fl.Usage
		if fl.DefValue != "" && !strings.Contains(usage, "(default") {
			usage += " (default " + fl.DefValue + ")"
		}
		fmt.Fprintf(w, "%s\n      %s\n", line, usage)
	})
}
