package ordersapp

import (
	"context"
	"strings"
	"testing"

	"github.com/idem-go/idem/idemdriver"
)

// TestKeysRedriveOperation: --operation re-drives the key only when
// its operation is the one named; another is refused (exit 1, one line,
// nothing changed), a value that is no operation id is a usage error.
func TestKeysRedriveOperation(t *testing.T) {
	dir := t.TempDir()
	seedKeys(t, dir)
	ctx := context.Background()
	be, err := openBackend(ctx, &Config{DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := be.store.Get(ctx, "alice", "rdv-given-up")
	be.close()
	if err != nil {
		t.Fatal(err)
	}
	op := idemdriver.OperationID("alice", "rdv-given-up", rec.CreatedAt)
	redrive := func(extra ...string) (int, string, string) {
		return run(t, nil, append([]string{"keys", "redrive", "--user", "alice", "--key", "rdv-given-up", "--data-dir", dir}, extra...)...)
	}
	for _, bad := range []string{"xyz", strings.ToUpper(op), op + "0", "0123456789abcde\n"} {
		if code, out, errs := redrive("--operation", bad); code != 2 || out != "" || strings.Count(errs, "\n") != 1 || !strings.Contains(errs, "--operation") {
			t.Errorf("--operation %q: exit %d, %q %q; want a usage error", bad, code, out, errs)
		}
	}
	other := "0123456789abcdef"
	code, out, errs := redrive("--operation", other)
	if code != 1 || out != "" || strings.Count(errs, "\n") != 1 || !strings.Contains(errs, "refused") || !strings.Contains(errs, op) {
		t.Errorf("--operation of another operation: exit %d, %q %q; want 1, refused naming %s", code, out, errs, op)
	}
	if code, out, errs := run(t, nil, "keys", "show", "--user", "alice", "--key", "rdv-given-up", "--data-dir", dir, "--json"); code != 0 || !strings.Contains(out, `"redrives": 20`) {
		t.Errorf("after the refused redrive: exit %d %s%s; want still 20 re-drives", code, out, errs)
	}
	code, out, errs = redrive("--operation", op)
	if code != 0 || !strings.Contains(out, op) || !strings.Contains(out, "ord_") || !strings.Contains(out, "given up after 20 re-drives") {
		t.Errorf("--operation %s: exit %d, %q %q; want re-driven, naming the operation and order", op, code, out, errs)
	}
}

// TestKeysQuotedKey: --key read as the middleware reads the header, so
// the sf-string form names the same key; a bad sf-string is a usage error.
func TestKeysQuotedKey(t *testing.T) {
	dir := t.TempDir()
	seedKeys(t, dir)
	if code, out, errs := run(t, nil, "keys", "show", "--user", "alice", "--key", `"rdv-done"`, "--data-dir", dir); code != 0 || !strings.Contains(out, "completed") {
		t.Errorf(`--key "rdv-done": exit %d %s%s; want the key rdv-done`, code, out, errs)
	}
	if code, _, errs := run(t, nil, "keys", "show", "--user", "alice", "--key", `"rdv-done`, "--data-dir", dir); code != 2 || !strings.Contains(errs, "--key") {
		t.Errorf(`--key "rdv-done (unterminated): exit %d %q; want a usage error`, code, errs)
	}
}

func TestRedactURL(t *testing.T) {
	for _, tc := range []struct{ in, hidden, want string }{
		{"mysql://root:hunter2@db/x", "hunter2", "mysql://root:xxxxx@db/x"},
		{"postgres://root:hunter2@127.0.0.1:notaport/x", "hunter2", "postgres://root:xxxxx@127.0.0.1:notaport/x"},
		{"postgres://root:1/2sekrit@host/db", "2sekrit", ""},
		{"postgres://root:p#sekrit@host/db", "sekrit", ""},
		{"mysql:root:sekrit@db", "sekrit", ""},
		{"postgres://host:5432/db", "", "postgres://host:5432/db"},
	} {
		got := redactURL(tc.in)
		if tc.hidden != "" && strings.Contains(got, tc.hidden) {
			t.Errorf("redactURL(%q) = %q: shows %q", tc.in, got, tc.hidden)
		}
		if tc.want != "" && got != tc.want {
			t.Errorf("redactURL(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestKeysHelpers(t *testing.T) {
	for in, want := range map[string]string{
		"/v1/orders":                    "/v1/orders",
		"/v1/orders?access_token=s&x=1": "/v1/orders?access_token=…&x=…",
		"/v1/orders?sekrit&&a=":         "/v1/orders?…&&a=…",
	} {
		if got := withoutQueryValues(in); got != want {
			t.Errorf("withoutQueryValues(%q) = %q, want %q", in, got, want)
		}
	}
	for in, want := range map[string]string{"abc": "abc", "\xff": `"\xff"`, "a b": `"a b"`, "caf\u00e9": "caf\u00e9"} {
		if got := quoteIfNeeded(in); got != want {
			t.Errorf("quoteIfNeeded(%q) = %q, want %q", in, got, want)
		}
	}
	for in, want := range map[string]string{
		"plain": "plain",
		"failed to connect to `x`:\n\ta: refused\n\tb: refused\n": "failed to connect to `x`: a: refused; b: refused",
	} {
		if got := oneLine(in); got != want {
			t.Errorf("oneLine(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestKeysConnectErrorOneLine: a database that cannot be reached is
// reported on one line (pgconn gives each address tried a line).
func TestKeysConnectErrorOneLine(t *testing.T) {
	code, out, errs := run(t, nil, "keys", "list", "--state", "given-up", "--database-url", "postgres://root:hunter2@127.0.0.1:1/x?connect_timeout=2")
	if code != 1 || out != "" || strings.Count(errs, "\n") != 1 || strings.Contains(errs, "hunter2") {
		t.Errorf("unreachable database: exit %d, stdout %q, stderr %q; want 1 and one line, no password", code, out, errs)
	}
}
