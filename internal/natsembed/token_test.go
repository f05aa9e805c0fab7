package natsembed_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/idem-go/idem/internal/natsembed"
)

// TestTokenRefusesOtherClients: a server with a token refuses a client
// without it or with another one, and serves one that gives it,
// JetStream included.
func TestTokenRefusesOtherClients(t *testing.T) {
	tok, err := natsembed.LoadOrCreateToken(filepath.Join(t.TempDir(), "nats.token"))
	if err != nil {
		t.Fatal(err)
	}
	s := start(t, natsembed.Options{Dir: t.TempDir(), Token: tok})
	for name, opts := range map[string][]nats.Option{
		"no token":      nil,
		"another token": {nats.Token(strings.Repeat("0", len(tok)))},
		"a user":        {nats.UserInfo("mallory", tok)},
	} {
		nc, err := nats.Connect(s.URL(), opts...)
		if err == nil {
			nc.Close()
			t.Errorf("%s: connected; want the server to refuse it", name)
			continue
		}
		if !errors.Is(err, nats.ErrAuthorization) {
			t.Errorf("%s: %v; want an authorization violation", name, err)
		}
		if strings.Contains(err.Error(), tok) {
			t.Errorf("%s: the error %q holds the token", name, err)
		}
	}
	nc, err := nats.Connect(s.URL(), nats.Token(tok))
	if err != nil {
		t.Fatalf("with the token: %v", err)
	}
	defer nc.Close()
	if _, err := nc.JetStream(); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

// TestLoadOrCreateToken: the first call makes a random token in a file of
// mode 0600, later calls (and ReadToken) return it, callers at once agree
// on one, and a file other users may read is refused.
func TestLoadOrCreateToken(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "nats.token")
	if _, err := natsembed.ReadToken(path); !errors.Is(err, natsembed.ErrNoToken) {
		t.Fatalf("ReadToken before any: %v, want ErrNoToken", err)
	}
	var wg sync.WaitGroup
	toks := make([]string, 8)
	errs := make([]error, len(toks))
	for i := range toks {
		wg.Go(func() { toks[i], errs[i] = natsembed.LoadOrCreateToken(path) })
	}
	wg.Wait()
	for i := range toks {
		if errs[i] != nil {
			t.Fatalf("call %d: %v", i, errs[i])
		}
		if toks[i] != toks[0] {
			t.Fatalf("call %d got another token than call 0", i)
		}
	}
	if len(toks[0]) != 64 {
		t.Errorf("token of %d characters, want 64", len(toks[0]))
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("mode %v, want 0600", fi.Mode().Perm())
	}
	if again, err := natsembed.LoadOrCreateToken(path); err != nil || again != toks[0] {
		t.Errorf("second start: %v (same token: %v)", err, again == toks[0])
	}
	if got, err := natsembed.ReadToken(path); err != nil || got != toks[0] {
		t.Errorf("ReadToken: %v (same token: %v)", err, got == toks[0])
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("the directory holds %d files, want the token file alone (no temporary file left)", len(entries))
	}

	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	for name, fn := range map[string]func(string) (string, error){"ReadToken": natsembed.ReadToken, "LoadOrCreateToken": natsembed.LoadOrCreateToken} {
		if _, err := fn(path); err == nil || !strings.Contains(err.Error(), "other users") {
			t.Errorf("%s of a file of mode 0644: %v; want a refusal", name, err)
		} else if strings.Contains(err.Error(), toks[0]) {
			t.Errorf("%s: the error holds the token", name)
		}
	}
}
