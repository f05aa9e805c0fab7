package cli

import (
	"errors"
	"flag"
	"strings"
	"testing"
	"time"
)

// demoFlags is a FlagSet with a plain, a checked and a secret flag.
func demoFlags(env map[string]string) (*FlagSet, *string, *time.Duration, *string) {
	fs := NewFlagSet("demo serve", "A demo.", func(k string) string { return env[k] })
	var addr, url string
	var wait time.Duration
	fs.String(&addr, "addr", "DEMO_ADDR", "127.0.0.1:1", "address")
	fs.Duration(&wait, "wait", "DEMO_WAIT", time.Second, "wait")
	fs.Func("database-url", "DEMO_DATABASE_URL", "in memory", "database", func(v string) error {
		if !strings.HasPrefix(v, "postgres://") {
			return errors.New("want postgres://…")
		}
		url = v
		return nil
	})
	fs.Secret("database-url")
	return fs, &addr, &wait, &url
}

// TestFlagWinsOverBadEnv: a flag wins over its variable, even over a
// bad value of it; a variable fills the flags not given.
func TestFlagWinsOverBadEnv(t *testing.T) {
	fs, addr, wait, url := demoFlags(map[string]string{"DEMO_WAIT": "soon", "DEMO_ADDR": "env:1", "DEMO_DATABASE_URL": "postgres://env"})
	if err := fs.Parse([]string{"--wait", "2s"}); err != nil {
		t.Fatalf("Parse: %v", err)
	}
	if *wait != 2*time.Second || *addr != "env:1" || *url != "postgres://env" {
		t.Errorf("wait %v, addr %q, url %q; want 2s from the flag, the rest from the environment", *wait, *addr, *url)
	}
	fs, _, _, _ = demoFlags(map[string]string{"DEMO_WAIT": "soon"})
	var ue *UsageError
	if err := fs.Parse(nil); !errors.As(err, &ue) || !strings.Contains(err.Error(), "DEMO_WAIT") {
		t.Errorf("Parse with a bad DEMO_WAIT alone = %v, want a usage error naming it", err)
	}
}

// TestFlagErrors: errors name flags --name, are usage errors, and never
// repeat the value of a Secret flag; --help is flag.ErrHelp.
func TestFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		args      []string
		env       map[string]string
		want, not string
	}{
		{[]string{"--nope"}, nil, "--nope", ""},
		{[]string{"--wait"}, nil, "--wait", ""},
		{[]string{"--wait", "soon"}, nil, `invalid value "soon" for --wait`, ""},
		{[]string{"--database-url", "mysql://u:s3cret@h"}, nil, "--database-url", "s3cret"},
		{[]string{"--database-url=mysql://u:s3cret@h"}, nil, "--database-url", "s3cret"},
		{nil, map[string]string{"DEMO_DATABASE_URL": "mysql://u:s3cret@h"}, "DEMO_DATABASE_URL", "s3cret"},
		{[]string{"extra"}, nil, `unexpected argument "extra"`, ""},
	} {
		fs, _, _, _ := demoFlags(tc.env)
		err := fs.Parse(tc.args)
		var ue *UsageError
		if !errors.As(err, &ue) || !strings.HasPrefix(ue.Msg, "demo serve: ") || !strings.Contains(ue.Msg, tc.want) || (tc.not != "" && strings.Contains(ue.Msg, tc.not)) {
			t.Errorf("%v %v: %v; want a usage error with %q, without %q", tc.args, tc.env, err, tc.want, tc.not)
		}
	}
	fs, _, _, _ := demoFlags(nil)
	if err := fs.Parse([]string{"--help"}); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("--help: %v, want flag.ErrHelp", err)
	}
	var b strings.Builder
	fs.PrintUsage(&b)
	for _, want := range []string{"--database-url  [$DEMO_DATABASE_URL]", "(default in memory)", "--wait  [$DEMO_WAIT]", "(default 1s)"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("help lacks %q:\n%s", want, b.String())
		}
	}
}
