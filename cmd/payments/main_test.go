package main

import (
	"bufio"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// build compiles the command into a temporary directory.
func build(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the binary")
	}
	bin := filepath.Join(t.TempDir(), "payments")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

func exitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}

func TestExitCodes(t *testing.T) {
	bin := build(t)
	for _, tc := range []struct {
		args []string
		want int
	}{
		{[]string{"serve", "--help"}, 0},
		{[]string{"serve", "--nope"}, 2},
		{[]string{"serve", "--fail-after-charge", "2"}, 2},
		{[]string{"serve", "--database-url", "postgres://x"}, 2},
		{[]string{"frobnicate"}, 2},
	} {
		cmd := exec.Command(bin, tc.args...)
		cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
		out, err := cmd.CombinedOutput()
		if got := exitCode(err); got != tc.want {
			t.Errorf("payments %s: exit code %d, want %d\n%s", strings.Join(tc.args, " "), got, tc.want, out)
		}
	}
}

func TestServeStopsOnSIGTERM(t *testing.T) {
	bin := build(t)
	cmd := exec.Command(bin, "serve", "--addr", "127.0.0.1:0")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "PAYMENTS_LATENCY=300ms"}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()

	lines := bufio.NewScanner(stderr)
	re := regexp.MustCompile(`url=(http://\S+)`)
	var base string
	for base == "" && lines.Scan() {
		if m := re.FindStringSubmatch(lines.Text()); m != nil {
			base = m[1]
		}
	}
	if base == "" {
		t.Fatal("no listening line")
	}
	go io.Copy(io.Discard, stderr)

	// A charge in flight when the signal comes is finished, not cut off.
	type answer struct {
		status int
		err    error
	}
	answered := make(chan answer, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, base+"/v1/payment_intents",
			strings.NewReader("amount=100&currency=eur&confirm=true&payment_method=pm_card_visa"))
		req.Header.Set("Authorization", "Bearer sk_test_x")
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("Idempotency-Key", "k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			answered <- answer{err: err}
			return
		}
		resp.Body.Close()
		answered <- answer{status: resp.StatusCode}
	}()
	time.Sleep(100 * time.Millisecond)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	a := <-answered
	if a.err != nil || a.status != http.StatusOK {
		t.Errorf("in-flight charge: status %d, err %v; want 200", a.status, a.err)
	}
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	select {
	case err := <-waited:
		if code := exitCode(err); code != 0 {
			t.Errorf("exit code %d, want 0", code)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("payments serve did not stop on SIGTERM")
	}
}
