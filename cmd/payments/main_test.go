package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/pgtest"
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
		{[]string{"serve", "--database-url", "mysql://x"}, 2},
		{[]string{"serve", "--database-url", "sqlite:"}, 2},
		{[]string{"serve", "--addr", "127.0.0.1:0", "--database-url", "postgres://127.0.0.1:1/x?connect_timeout=5"}, 1},
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
	// The charge is in flight once the server's handler reads its body:
	// it asks for it with "100 Continue" (Expect: 100-continue), which the
	// client waits for before it sends the body.
	answered := make(chan answer, 1)
	reading := make(chan struct{})
	go func() {
		trace := &httptrace.ClientTrace{Got100Continue: func() { close(reading) }}
		req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), http.MethodPost, base+"/v1/payment_intents",
			strings.NewReader("amount=100&currency=eur&confirm=true&payment_method=pm_card_visa"))
		req.Header.Set("Authorization", "Bearer sk_test_x")
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("Idempotency-Key", "k")
		req.Header.Set("Expect", "100-continue")
		tr := &http.Transport{ExpectContinueTimeout: time.Minute} // the body waits for 100 Continue
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr}).Do(req)
		if err != nil {
			answered <- answer{err: err}
			return
		}
		resp.Body.Close()
		answered <- answer{status: resp.StatusCode}
	}()
	select {
	case <-reading:
	case a := <-answered:
		t.Fatalf("the charge was answered (status %d, err %v) before its body was read", a.status, a.err)
	case <-time.After(15 * time.Second):
		t.Fatal("the server never read the charge's body")
	}
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

// serveProcess is a running `payments serve`.
type serveProcess struct {
	cmd  *exec.Cmd
	base string // http://host:port
}

// startServe starts bin serve on a free port with env, and waits until it
// listens.
func startServe(t *testing.T, bin string, env ...string) *serveProcess {
	t.Helper()
	cmd := exec.Command(bin, "serve", "--addr", "127.0.0.1:0")
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); _ = cmd.Wait() })
	lines := bufio.NewScanner(stderr)
	re := regexp.MustCompile(`url=(http://\S+)`)
	var base string
	var seen []string
	for base == "" && lines.Scan() {
		seen = append(seen, lines.Text())
		if m := re.FindStringSubmatch(lines.Text()); m != nil {
			base = m[1]
		}
	}
	if base == "" {
		t.Fatalf("no listening line:\n%s", strings.Join(seen, "\n"))
	}
	go io.Copy(io.Discard, stderr)
	return &serveProcess{cmd: cmd, base: base}
}

// stop sends SIGTERM and waits for a clean exit.
func (p *serveProcess) stop(t *testing.T) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waited := make(chan error, 1)
	go func() { waited <- p.cmd.Wait() }()
	select {
	case err := <-waited:
		if code := exitCode(err); code != 0 {
			t.Fatalf("exit code %d, want 0", code)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("payments serve did not stop on SIGTERM")
	}
}

// charge creates a PaymentIntent with key and returns the status, the
// Idempotent-Replayed header and the body.
func (p *serveProcess) charge(t *testing.T, key string) (int, string, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, p.base+"/v1/payment_intents",
		strings.NewReader("amount=100&currency=eur&confirm=true&payment_method=pm_card_visa&metadata[order_ref]=ord_1"))
	req.Header.Set("Authorization", "Bearer sk_test_x")
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), string(b)
}

// listed returns the IDs of the account's PaymentIntents.
func (p *serveProcess) listed(t *testing.T) []string {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, p.base+"/v1/payment_intents?limit=100", nil)
	req.Header.Set("Authorization", "Bearer sk_test_x")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, pi := range list.Data {
		ids = append(ids, pi.ID)
	}
	return ids
}

// testRestart charges, restarts the gateway on the same database, and
// repeats the charge: a replay of the same PaymentIntent, and only one.
func testRestart(t *testing.T, bin string, env ...string) {
	t.Helper()
	p := startServe(t, bin, env...)
	status, replayed, first := p.charge(t, "user-1/order-1")
	if status != http.StatusOK || replayed != "" {
		t.Fatalf("first charge: %d replayed %q: %s", status, replayed, first)
	}
	p.stop(t)

	p = startServe(t, bin, env...)
	status, replayed, again := p.charge(t, "user-1/order-1")
	if status != http.StatusOK || replayed != "true" || again != first {
		t.Errorf("charge after the restart: %d replayed %q:\n%s\nwant the replay of\n%s", status, replayed, again, first)
	}
	if ids := p.listed(t); len(ids) != 1 {
		t.Errorf("PaymentIntents after the restart: %v, want one", ids)
	}
	p.stop(t)
}

func TestServeRestartSQLite(t *testing.T) {
	bin := build(t)
	testRestart(t, bin, "PAYMENTS_DATABASE_URL=sqlite:"+filepath.Join(t.TempDir(), "data", "payments.db"))
}

func TestServeRestartPostgres(t *testing.T) {
	base, schema := pgtest.SchemaName(t) // created by serve
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Skipf("TEST_DATABASE_URL is not a postgres:// URL, which --database-url needs")
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	bin := build(t)
	testRestart(t, bin, "PAYMENTS_DATABASE_URL="+u.String())
}

// post sends form to path with key and returns the status, the
// Idempotent-Replayed header and the body.
func (p *serveProcess) post(t *testing.T, path, key string, form url.Values) (int, string, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, p.base+path, strings.NewReader(form.Encode()))
	req.Header.Set("Authorization", "Bearer sk_test_x")
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), string(b)
}

// TestServeOversizeDescriptionAndRefundOnPostgres runs issue 8's reproduction against `payments serve` on
// PostgreSQL: a description too long to store is refused each time and
// charges nothing, and a refund is made once, replayed, and kept across a
// restart.
func TestServeOversizeDescriptionAndRefundOnPostgres(t *testing.T) {
	base, schema := pgtest.SchemaName(t) // created by serve
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Skipf("TEST_DATABASE_URL is not a postgres:// URL, which --database-url needs")
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	env := "PAYMENTS_DATABASE_URL=" + u.String()
	bin := build(t)
	p := startServe(t, bin, env)

	form := url.Values{"amount": {"100"}, "currency": {"eur"}, "confirm": {"true"}, "payment_method": {"pm_card_visa"}}
	for _, desc := range []string{strings.Repeat("a", 1_048_400), strings.Repeat("<", 175_000)} {
		form.Set("description", desc)
		for i := range 2 {
			status, _, body := p.post(t, "/v1/payment_intents", "oversize-"+desc[:1], form)
			if status != http.StatusBadRequest || !strings.Contains(body, `"parameter_invalid_string"`) || !strings.Contains(body, `"param": "description"`) {
				t.Errorf("description of %d %q, attempt %d: %d %.300s; want 400 parameter_invalid_string", len(desc), desc[:1], i, status, body)
			}
		}
	}
	if ids := p.listed(t); len(ids) != 0 {
		t.Fatalf("PaymentIntents after refused requests: %v, want none", ids)
	}

	form.Set("description", strings.Repeat("<", 1000))
	status, _, body := p.post(t, "/v1/payment_intents", "pay", form)
	if status != http.StatusOK {
		t.Fatalf("charge: %d %s", status, body)
	}
	var pi struct{ ID string }
	if err := json.Unmarshal([]byte(body), &pi); err != nil {
		t.Fatal(err)
	}
	refund := url.Values{"payment_intent": {pi.ID}}
	status, replayed, first := p.post(t, "/v1/refunds", "refund", refund)
	if status != http.StatusOK || replayed != "" || !strings.Contains(first, `"object": "refund"`) {
		t.Fatalf("refund: %d replayed %q: %s", status, replayed, first)
	}
	p.stop(t)

	p = startServe(t, bin, env)
	status, replayed, again := p.post(t, "/v1/refunds", "refund", refund)
	if status != http.StatusOK || replayed != "true" || again != first {
		t.Errorf("refund after the restart: %d replayed %q:\n%s\nwant the replay of\n%s", status, replayed, again, first)
	}
	if status, _, body := p.post(t, "/v1/refunds", "refund-again", refund); status != http.StatusBadRequest || !strings.Contains(body, "charge_already_refunded") {
		t.Errorf("second refund: %d %s, want 400 charge_already_refunded", status, body)
	}
	req, _ := http.NewRequest(http.MethodGet, p.base+"/v1/refunds?payment_intent="+pi.ID, nil)
	req.Header.Set("Authorization", "Bearer sk_test_x")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Object string            `json:"object"`
		Data   []json.RawMessage `json:"data"`
		URL    string            `json:"url"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil || list.Object != "list" || list.URL != "/v1/refunds" || len(list.Data) != 1 {
		t.Errorf("GET /v1/refunds: %+v, %v; want a list of one refund", list, err)
	}
	p.stop(t)
}
