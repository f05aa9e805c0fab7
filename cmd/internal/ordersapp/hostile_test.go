package ordersapp

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A --jwt-secret shorter than 32 bytes is refused at start, for serve and
// for token alike (exit 2, one line, the secret not repeated).
func TestShortJWTSecretRefused(t *testing.T) {
	const short = "not-32-bytes-long-at-all"
	for _, args := range [][]string{
		{"serve", "--data-dir", t.TempDir(), "--jwt-secret", short},
		{"token", "--user", "alice", "--data-dir", t.TempDir(), "--jwt-secret", short},
	} {
		code, _, errs := run(t, nil, args...)
		if code != 2 || strings.Count(strings.TrimSpace(errs), "\n") != 0 || !strings.Contains(errs, "--jwt-secret") || strings.Contains(errs, short) {
			t.Errorf("%s with a %d-byte secret: exit %d, stderr %q; want 2 and one line naming the flag, not the secret", args[0], len(short), code, errs)
		}
	}
	if code, _, errs := run(t, map[string]string{"ORDERS_JWT_SECRET": short}, "token", "--user", "alice", "--data-dir", t.TempDir()); code != 2 {
		t.Errorf("ORDERS_JWT_SECRET of %d bytes: exit %d (%s), want 2", len(short), code, errs)
	}
	if code, out, errs := run(t, nil, "token", "--user", "alice", "--data-dir", t.TempDir(), "--jwt-secret", strings.Repeat("s", 32)); code != 0 || out == "" {
		t.Errorf("a 32-byte secret: exit %d (%s), want a token", code, errs)
	}
}

// A <data-dir>/jwt-secret file shorter than 32 bytes is refused as the flag
// is, for serve and for token: it fails at start, naming the file and not
// repeating the secret.
func TestShortJWTSecretFileRefused(t *testing.T) {
	const short = "short-file-secret"
	for _, cmd := range []string{"serve", "token"} {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "jwt-secret"), []byte(short+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		args := []string{cmd, "--data-dir", dir}
		if cmd == "token" {
			args = append(args, "--user", "alice")
		} else {
			args = append(args, "--addr", freeAddr(t))
		}
		code, _, errs := run(t, nil, args...)
		if code == 0 || !strings.Contains(errs, "jwt-secret") || !strings.Contains(errs, "at least 32") || strings.Contains(errs, short) {
			t.Errorf("%s with a %d-byte secret file: exit %d, stderr %q; want a failure naming the file, not the secret", cmd, len(short), code, errs)
		}
	}
}

// With --metrics-addr, /metrics is served there and only there.
func TestMetricsAddr(t *testing.T) {
	addr, maddr := freeAddr(t), freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var out, errb syncBuffer
	a := &App{Stdout: &out, Stderr: &errb, Getenv: func(string) string { return "" }}
	go func() {
		done <- a.Run(ctx, []string{"serve", "--data-dir", t.TempDir(), "--addr", addr, "--metrics-addr", maddr})
	}()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			t.Error("serve did not stop")
		}
	}()
	get := func(url string) (int, string) {
		resp, err := http.Get(url)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		if s, _ := get("http://" + addr + "/healthz"); s == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("serve did not answer: %s", errb.String())
		}
		time.Sleep(50 * time.Millisecond) // a poll with a deadline: ends as soon as serve answers
	}
	if s, body := get("http://" + maddr + "/metrics"); s != http.StatusOK || !strings.Contains(body, "idem_") {
		t.Errorf("GET /metrics on --metrics-addr: %d %.200s; want 200 with the counters", s, body)
	}
	if s, _ := get("http://" + addr + "/metrics"); s != http.StatusNotFound {
		t.Errorf("GET /metrics on --addr: %d, want 404 when --metrics-addr is set", s)
	}
	if s, _ := get("http://" + maddr + "/v1/orders"); s != http.StatusNotFound {
		t.Errorf("GET /v1/orders on --metrics-addr: %d, want 404", s)
	}
}
