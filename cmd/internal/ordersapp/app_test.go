package ordersapp

import (
	"bytes"
	"context"
	"database/sql"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/testwait"
)

// run runs the orders command in process with env as its environment.
func run(t *testing.T, env map[string]string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	a := &App{Stdout: &out, Stderr: &errb, Getenv: func(k string) string { return env[k] }}
	code = a.Run(context.Background(), args)
	return code, out.String(), errb.String()
}

func TestUsageErrors(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name string
		env  map[string]string
		args []string
	}{
		{"no command", nil, nil},
		{"unknown command", nil, []string{"fly"}},
		{"unknown flag", nil, []string{"serve", "--nope"}},
		{"bad duration flag", nil, []string{"serve", "--key-ttl", "soon"}},
		{"negative duration", nil, []string{"serve", "--key-lease=-1s"}},
		{"bad bool env", map[string]string{"ORDERS_REQUIRE_KEY": "maybe"}, []string{"serve"}},
		{"bad duration env", map[string]string{"ORDERS_IN_FLIGHT_WAIT": "x"}, []string{"serve"}},
		{"zero lease", nil, []string{"serve", "--key-lease", "0s", "--data-dir", dir}},
		{"negative outbox retention", nil, []string{"serve", "--outbox-retention=-1h", "--data-dir", dir}},
		{"bad outbox retention env", map[string]string{"ORDERS_OUTBOX_RETENTION": "a week"}, []string{"serve", "--data-dir", dir}},
		{"bad database url", nil, []string{"migrate", "--database-url", "mysql://x", "--data-dir", dir}},
		{"bad payments url", nil, []string{"serve", "--payments-url", "ftp://x", "--data-dir", dir}},
		{"token without user", nil, []string{"token", "--data-dir", dir}},
		{"stray argument", nil, []string{"gc", "extra"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, _, stderr := run(t, tt.env, tt.args...)
			if code != 2 {
				t.Errorf("exit = %d, want 2 (stderr %q)", code, stderr)
			}
			if lines := strings.Count(strings.TrimRight(stderr, "\n"), "\n"); tt.args != nil && lines != 0 {
				t.Errorf("stderr has %d lines, want one: %q", lines+1, stderr)
			}
		})
	}
}

func TestHelpListsFlagsAndEnv(t *testing.T) {
	code, out, _ := run(t, nil, "serve", "--help")
	if code != 0 {
		t.Fatalf("exit = %d, want 0", code)
	}
	for _, want := range []string{"--addr", "ORDERS_ADDR", "127.0.0.1:8080", "--data-dir", "ORDERS_DATA_DIR", "--database-url", "DATABASE_URL",
		"--redis-url", "REDIS_URL", "--payments-url", "PAYMENTS_URL", "--jwt-secret", "ORDERS_JWT_SECRET", "--key-ttl", "ORDERS_KEY_TTL",
		"--require-key", "ORDERS_REQUIRE_KEY", "--in-flight-wait", "ORDERS_IN_FLIGHT_WAIT", "--key-lease", "ORDERS_KEY_LEASE",
		"--payments-key", "PAYMENTS_API_KEY", "sk_test_local", "--outbox-retention", "ORDERS_OUTBOX_RETENTION"} {
		if !strings.Contains(out, want) {
			t.Errorf("serve --help lacks %q", want)
		}
	}
	for _, cmd := range []string{"migrate", "token", "gc", "demo"} {
		if code, out, _ := run(t, nil, cmd, "--help"); code != 0 || !strings.Contains(out, "Usage: orders "+cmd) {
			t.Errorf("%s --help: exit %d, output %q", cmd, code, out)
		}
	}
	if code, out, _ := run(t, nil, "--help"); code != 0 || !strings.Contains(out, "serve") || !strings.Contains(out, "demo") {
		t.Errorf("--help: exit %d, output %q", code, out)
	}
}

func TestTokenSecretKeptInDataDir(t *testing.T) {
	dir := t.TempDir()
	_, tok1, _ := run(t, nil, "token", "--user", "alice", "--data-dir", dir)
	if _, err := os.Stat(filepath.Join(dir, "jwt-secret")); err != nil {
		t.Fatalf("secret not kept: %v", err)
	}
	// The env var names the data dir as well as the flag does; the flag wins.
	c1 := Config{DataDir: dir}
	s1, _ := c1.secret()
	c2 := Config{DataDir: dir}
	s2, _ := c2.secret()
	if string(s1) != string(s2) || len(s1) < 32 {
		t.Errorf("secrets differ or are short: %q %q", s1, s2)
	}
	if strings.Count(strings.TrimSpace(tok1), ".") != 2 {
		t.Errorf("token %q is not a JWT", tok1)
	}
	code, out, errs := run(t, map[string]string{"ORDERS_DATA_DIR": "/nonexistent/never"}, "token", "--user", "bob", "--data-dir", dir)
	if code != 0 || out == "" {
		t.Errorf("flag should win over env: exit %d, %q %q", code, out, errs)
	}
}

func TestDemo(t *testing.T) {
	skipInShort(t, "runs the whole demo")
	t.Parallel()
	code, out, errs := run(t, nil, "demo", "--keys", "40", "--copies", "3", "--clients", "12")
	if code != 0 {
		t.Fatalf("demo exit %d\n%s\n%s", code, out, errs)
	}
	for _, want := range []string{"distinct keys", "orders created", "charges made", "replays", "409 in flight", "5xx", "OK: orders = charges = distinct keys = 40"} {
		if !strings.Contains(out, want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
	t.Logf("demo:\n%s", out)
}

// proc is a started binary and its output.
type proc struct {
	cmd  *exec.Cmd
	logs *syncBuffer
}

// kill ends p at once, as a crash would, and reaps it.
func (p *proc) kill() {
	p.cmd.Process.Kill()
	_ = p.cmd.Wait() // killed: its exit status is the kill's
}

// syncBuffer is a bytes.Buffer safe for a process to write while the test reads.
type syncBuffer struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Binaries built once for the process tests.
var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

func binaries(t *testing.T) (orders, payments string) {
	t.Helper()
	skipInShort(t, "builds and runs the orders and payments binaries")
	buildOnce.Do(func() {
		binDir, buildErr = os.MkdirTemp("", "orders-bin-")
		if buildErr != nil {
			return
		}
		out, err := exec.Command("go", "build", "-o", binDir, "github.com/idem-go/idem/cmd/orders", "github.com/idem-go/idem/cmd/payments").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return filepath.Join(binDir, "orders"), filepath.Join(binDir, "payments")
}

// skipInShort skips t under go test -short, the inner loop (README): t
// is slow for the reason why gives. The full suite runs it.
func skipInShort(t *testing.T, why string) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: " + why + " (the full suite runs it)")
	}
}

// parallelWaiters is how many of the package's parallel tests run at
// once unless -parallel says otherwise. They are the tests that call
// t.Parallel: by the package's rule (docs/CONTRIBUTING.md) nothing in
// them depends on when something happens on a loaded machine, and most of
// their time is waiting (serve's fixed bounds, a gateway's latency, a
// storm judged by its outcome). go test's default, GOMAXPROCS (2 on the CI
// machine), left the CPU about half idle while they ran after the rest of
// the run was done. They start only when every sequential test of the
// package has ended, so no timing test runs beside four of them.
const parallelWaiters = 4

func TestMain(m *testing.M) {
	flag.Parse()
	explicit := false
	flag.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "test.parallel" })
	if !explicit {
		if err := flag.Set("test.parallel", strconv.Itoa(parallelWaiters)); err != nil {
			fmt.Fprintln(os.Stderr, "setting -test.parallel:", err)
			os.Exit(2)
		}
	}
	code := m.Run()
	stopFailoverFormation()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// start starts a binary, waits until url answers, and stops it when t
// ends (SIGINT, then SIGKILL after 10s).
func start(t *testing.T, url, bin string, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(bin, args...)
	logs := new(syncBuffer)
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState != nil {
			return // killed and reaped by the test
		}
		cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("%s logs:\n%s", filepath.Base(bin), logs.String())
		}
	})
	for i := 0; i < 200; i++ {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusUnauthorized {
				return &proc{cmd: cmd, logs: logs}
			}
		}
		time.Sleep(25 * time.Millisecond) // a poll with a deadline (200 tries): ends as soon as the service answers
	}
	t.Fatalf("%s did not come up at %s", bin, url)
	return nil
}

type answer struct {
	status int
	header http.Header
	body   string
}

func call(t *testing.T, method, url, token, key, body string) answer {
	t.Helper()
	a, err := tryCall(http.DefaultClient, method, url, token, key, body)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// tryCall is call without t, for goroutines other than the test's: it
// returns the error call would fail the test with.
func tryCall(client *http.Client, method, url, token, key, body string) (answer, error) {
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return answer{}, fmt.Errorf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, resp.Header, string(b)}, nil
}

// TestReadmeSession runs the README's curl session against real processes:
// orders serve on the embedded default, paying through payments serve with
// added latency so that a duplicate finds the first still in flight.
func TestReadmeSession(t *testing.T) {
	ordersBin, paymentsBin := binaries(t)
	dir := t.TempDir()
	payAddr, ordAddr := freeAddr(t), freeAddr(t)
	start(t, "http://"+payAddr+"/v1/payment_intents", paymentsBin, "serve", "--addr", payAddr, "--latency", "1s")
	start(t, "http://"+ordAddr+"/healthz", ordersBin, "serve", "--addr", ordAddr, "--data-dir", dir, "--payments-url", "http://"+payAddr)

	out, err := exec.Command(ordersBin, "token", "--user", "alice", "--data-dir", dir).Output()
	if err != nil {
		t.Fatalf("orders token: %v", err)
	}
	tok := strings.TrimSpace(string(out))
	base := "http://" + ordAddr
	body := `{"items":[{"sku":"SKU-1","quantity":2,"unit_price":1299}],"currency":"EUR"}`

	first := call(t, "POST", base+"/v1/orders", tok, "order-1", body)
	if first.status != 201 || first.header.Get("Location") == "" || !strings.Contains(first.body, `"total":2598`) || !strings.Contains(first.body, `"status":"paid"`) {
		t.Fatalf("create: %d %v %s", first.status, first.header, first.body)
	}
	replay := call(t, "POST", base+"/v1/orders", tok, `"order-1"`, "{ \"currency\":\"EUR\", \"items\":[{\"unit_price\":1299,\"quantity\":2,\"sku\":\"SKU-1\"}] }")
	if replay.status != 201 || replay.body != first.body || replay.header.Get("Idempotent-Replayed") != "true" || replay.header.Get("Location") != first.header.Get("Location") {
		t.Fatalf("replay: %d %v %s", replay.status, replay.header, replay.body)
	}
	mismatch := call(t, "POST", base+"/v1/orders", tok, "order-1", strings.Replace(body, `"quantity":2`, `"quantity":3`, 1))
	if mismatch.status != 422 || mismatch.header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("mismatch: %d %s", mismatch.status, mismatch.body)
	}

	// In flight: the first request waits a second on the gateway.
	bg := make(chan answer)
	go func() {
		req, _ := http.NewRequest("POST", base+"/v1/orders", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+tok)
		req.Header.Set("Idempotency-Key", "order-2")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			bg <- answer{}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		bg <- answer{resp.StatusCode, resp.Header, string(b)}
	}()
	keysDB, err := sql.Open("sqlite", filepath.Join(dir, "orders.db")+"?_pragma=busy_timeout(10000)")
	if err != nil {
		t.Fatal(err)
	}
	defer keysDB.Close()
	testwait.Until(t, 0, "order-2's first attempt to hold its key", func() bool {
		var n int
		if err := keysDB.QueryRow(`SELECT count(*) FROM idempotency_keys WHERE key = 'order-2' AND response_status IS NULL`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	})
	dup := call(t, "POST", base+"/v1/orders", tok, "order-2", body)
	if dup.status != 409 || dup.header.Get("Retry-After") == "" {
		t.Fatalf("duplicate in flight: %d %v %s", dup.status, dup.header, dup.body)
	}
	if a := <-bg; a.status != 201 {
		t.Fatalf("order-2 first attempt: %d %s", a.status, a.body)
	}

	list := call(t, "GET", base+"/v1/orders", tok, "", "")
	if list.status != 200 || strings.Count(list.body, `"id":"ord_`) != 2 {
		t.Fatalf("list: %d %s", list.status, list.body)
	}
	if got := call(t, "GET", base+first.header.Get("Location"), tok, "", ""); got.status != 200 {
		t.Fatalf("get own order: %d", got.status)
	}
	out, _ = exec.Command(ordersBin, "token", "--user", "mallory", "--data-dir", dir).Output()
	if got := call(t, "GET", base+first.header.Get("Location"), strings.TrimSpace(string(out)), "", ""); got.status != 404 {
		t.Fatalf("another user's order: %d, want 404", got.status)
	}
	if got := call(t, "POST", base+"/v1/orders", "", "order-3", body); got.status != 401 {
		t.Fatalf("no token: %d, want 401", got.status)
	}
}
