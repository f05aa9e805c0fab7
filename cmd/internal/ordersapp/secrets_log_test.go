package ordersapp

import (
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/testwait"
)

// TestNoCredentialInLogsOrErrors: a password in a key=value --database-url
// (bare or quoted) is not echoed by the usage error, and the user info of
// a --payments-url is not logged at start. Both were, verbatim.
func TestNoCredentialInLogsOrErrors(t *testing.T) {
	for _, dsn := range []string{
		"host=db password=s3cretpw sslmode=bogus",
		"host=db password='s3cret pw' user=u",
		"PASSWORD = s3cretpw host=db",
	} {
		for _, cmd := range []string{"gc", "audit", "serve"} {
			code, stdout, stderr := run(t, nil, cmd, "--data-dir", t.TempDir(), "--database-url", dsn)
			if code == 0 || strings.Contains(stdout+stderr, "s3cret") {
				t.Errorf("%s --database-url %q: exit %d, output %q; want an error without the password", cmd, dsn, code, stdout+stderr)
			}
		}
	}
	if got := redactURL("host=db password=s3cretpw"); got != "host=db password=xxxxx" {
		t.Errorf("redactURL = %q", got)
	}

	ordersBin, _ := binaries(t)
	addr := freeAddr(t)
	p := start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", t.TempDir(), "--jwt-secret", testSecret,
		"--payments-url", "http://gwuser:s3cretpw@127.0.0.1:1")
	testwait.Until(t, 10*time.Second, "serve's listening line", func() bool { return strings.Contains(p.logs.String(), "orders: listening") })
	if logs := p.logs.String(); strings.Contains(logs, "s3cretpw") || !strings.Contains(logs, "payments=http://gwuser:xxxxx@127.0.0.1:1") {
		t.Errorf("serve's logs hold the --payments-url password, or not the redacted URL:\n%s", tail(logs, 10))
	}
	code, stdout, stderr := run(t, nil, "serve", "--data-dir", t.TempDir(), "--payments-url", "ftp://gwuser:s3cretpw@h/")
	if code != 2 || strings.Contains(stdout+stderr, "s3cretpw") {
		t.Errorf("serve --payments-url ftp://…: exit %d, output %q; want 2 without the password", code, stdout+stderr)
	}
}

// TestUserBoundFlags: --user-rate and --max-keys-per-user refuse what is
// not a number in range (exit 2) and --help names them with their
// variables.
func TestUserBoundFlags(t *testing.T) {
	for _, args := range [][]string{{"--user-rate", "-1"}, {"--user-rate", "fast"}, {"--max-keys-per-user", "-5"}} {
		code, _, stderr := run(t, nil, append([]string{"serve", "--data-dir", t.TempDir()}, args...)...)
		if code != 2 || !strings.Contains(stderr, strings.TrimPrefix(args[0], "--")) {
			t.Errorf("serve %v: exit %d, stderr %q; want 2 naming the flag", args, code, stderr)
		}
	}
	_, stdout, stderr := run(t, nil, "serve", "--help")
	for _, want := range []string{"--user-rate", "ORDERS_USER_RATE", "--max-keys-per-user", "ORDERS_MAX_KEYS_PER_USER"} {
		if !strings.Contains(stdout+stderr, want) {
			t.Errorf("serve --help does not name %s", want)
		}
	}
}
