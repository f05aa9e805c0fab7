package paymentsapp

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/testwait"
)

func envOf(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

// runCLI runs the payments command with args and getenv.
func runCLI(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	return (&App{Args: args, Getenv: getenv, Stdout: stdout, Stderr: stderr}).Run(ctx)
}

func TestParseServe(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want serveConfig
	}{
		{"defaults", nil, nil, serveConfig{addr: "127.0.0.1:8081"}},
		{
			"flags",
			[]string{"--addr", ":9000", "--api-key", "sk_test_x", "--latency", "250ms", "--fail-after-charge", "0.25", "--decline-over=5000"},
			nil,
			serveConfig{addr: ":9000", apiKey: "sk_test_x", latency: 250 * time.Millisecond, failAfterCharge: 0.25, declineOver: 5000},
		},
		{
			"env",
			nil,
			map[string]string{"PAYMENTS_ADDR": "0.0.0.0:1", "PAYMENTS_API_KEY": "sk_test_env", "PAYMENTS_LATENCY": "1s", "PAYMENTS_FAIL_AFTER_CHARGE": "1", "PAYMENTS_DECLINE_OVER": "7"},
			serveConfig{addr: "0.0.0.0:1", apiKey: "sk_test_env", latency: time.Second, failAfterCharge: 1, declineOver: 7},
		},
		{
			"postgres",
			[]string{"--database-url", "postgres://u:pw@db:5432/payments?sslmode=disable"},
			nil,
			serveConfig{addr: "127.0.0.1:8081", databaseURL: "postgres://u:pw@db:5432/payments?sslmode=disable"},
		},
		{
			"sqlite from env",
			nil,
			map[string]string{"PAYMENTS_DATABASE_URL": "sqlite:/var/lib/payments.db"},
			serveConfig{addr: "127.0.0.1:8081", databaseURL: "sqlite:/var/lib/payments.db"},
		},
		{
			"flag wins over env, even over a bad one",
			[]string{"-addr", "127.0.0.1:2", "-latency", "0"},
			map[string]string{"PAYMENTS_ADDR": "0.0.0.0:1", "PAYMENTS_LATENCY": "bad"},
			serveConfig{addr: "127.0.0.1:2"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseServe(tc.args, envOf(tc.env))
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("parseServe = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestRunCLIUsageErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want string // in the error line
	}{
		{"no command", nil, nil, "missing command"},
		{"unknown command", []string{"charge"}, nil, `unknown command "charge"`},
		{"unknown flag", []string{"serve", "--verbose"}, nil, "--verbose"},
		{"extra argument", []string{"serve", "now"}, nil, `unexpected argument "now"`},
		{"bad addr", []string{"serve", "--addr", "nowhere"}, nil, "--addr"},
		{"bad latency", []string{"serve", "--latency", "soon"}, nil, "--latency"},
		{"negative latency", []string{"serve", "--latency", "-1s"}, nil, "--latency"},
		{"fraction over 1", []string{"serve", "--fail-after-charge", "1.5"}, nil, "--fail-after-charge"},
		{"fraction not a number", []string{"serve", "--fail-after-charge", "NaN"}, nil, "--fail-after-charge"},
		{"negative decline-over", []string{"serve", "--decline-over", "-5"}, nil, "--decline-over"},
		{"missing value", []string{"serve", "--addr"}, nil, "--addr"},
		{"bad env", []string{"serve"}, map[string]string{"PAYMENTS_DECLINE_OVER": "lots"}, "PAYMENTS_DECLINE_OVER"},
		{"database url of another kind", []string{"serve", "--database-url", "mysql://db/payments"}, nil, "--database-url"},
		{"database url not parsed", []string{"serve", "--database-url", "postgres://db:port/payments"}, nil, "--database-url"},
		{"database url without a file", []string{"serve", "--database-url", "sqlite:"}, nil, "--database-url"},
		{"database url env", []string{"serve"}, map[string]string{"PAYMENTS_DATABASE_URL": "mysql://db"}, "PAYMENTS_DATABASE_URL"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := runCLI(context.Background(), tc.args, envOf(tc.env), &stdout, &stderr)
			if code != ExitUsage {
				t.Errorf("exit code = %d, want %d", code, ExitUsage)
			}
			msg := stderr.String()
			if strings.Count(msg, "\n") != 1 || !strings.HasSuffix(msg, "\n") {
				t.Errorf("stderr is not one line: %q", msg)
			}
			if !strings.Contains(msg, tc.want) {
				t.Errorf("stderr = %q, want it to mention %q", msg, tc.want)
			}
			if stdout.Len() != 0 {
				t.Errorf("stdout = %q, want nothing", stdout.String())
			}
		})
	}
}

// TestRunCLIDatabaseURLSecret: a database URL refused is not echoed, as it
// may hold a password.
func TestRunCLIDatabaseURLSecret(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  map[string]string
	}{
		{[]string{"serve", "--database-url", "mysql://u:s3cret@db/payments"}, nil},
		{[]string{"serve", "--database-url=postgres://u:s3cret@db:port/payments"}, nil},
		{[]string{"serve"}, map[string]string{"PAYMENTS_DATABASE_URL": "postgres://u:s3cret@db:port/payments"}},
	} {
		var stderr bytes.Buffer
		if code := runCLI(context.Background(), tc.args, envOf(tc.env), new(bytes.Buffer), &stderr); code != ExitUsage {
			t.Errorf("%v %v: exit code = %d, want %d", tc.args, tc.env, code, ExitUsage)
		}
		if strings.Contains(stderr.String(), "s3cret") {
			t.Errorf("%v %v: stderr shows the password: %s", tc.args, tc.env, stderr.String())
		}
	}
}

// TestRunCLIDatabaseDown: a database that does not answer is a failure
// (exit 1) reported on one line.
func TestRunCLIDatabaseDown(t *testing.T) {
	var stderr bytes.Buffer
	code := runCLI(context.Background(), []string{"serve", "--addr", "127.0.0.1:0", "--database-url", "postgres://u:s3cret@127.0.0.1:1/payments?connect_timeout=5"}, envOf(nil), new(bytes.Buffer), &stderr)
	if code != ExitFailure {
		t.Errorf("exit code = %d, want %d; stderr %s", code, ExitFailure, stderr.String())
	}
	if msg := stderr.String(); strings.Count(msg, "\n") != 1 || strings.Contains(msg, "s3cret") {
		t.Errorf("stderr = %q, want one line without the password", msg)
	}
}

func TestRunCLIHelp(t *testing.T) {
	for _, args := range [][]string{{"serve", "--help"}, {"serve", "-h"}} {
		var stdout, stderr bytes.Buffer
		if code := runCLI(context.Background(), args, envOf(nil), &stdout, &stderr); code != ExitOK {
			t.Errorf("%v: exit code = %d, want 0", args, code)
		}
		for _, o := range serveOptions {
			for _, want := range []string{"--" + o.name, o.env, "default " + o.def} {
				if !strings.Contains(stdout.String(), want) {
					t.Errorf("%v: help does not mention %q:\n%s", args, want, stdout.String())
				}
			}
		}
	}
	var stdout bytes.Buffer
	if code := runCLI(context.Background(), []string{"--help"}, envOf(nil), &stdout, new(bytes.Buffer)); code != ExitOK || !strings.Contains(stdout.String(), "payments serve") {
		t.Errorf("payments --help: code %d, output %q", code, stdout.String())
	}
}

// syncBuffer is a bytes.Buffer safe for one writer and one reader.
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

var listeningRE = regexp.MustCompile(`url=(http://\S+)`)

// listening waits (testwait.Until) for serve's listening line in stderr
// and returns its URL; it fails at once if serve returned (its exit code
// on done) before it listened.
func listening(t *testing.T, stderr *syncBuffer, done <-chan int) string {
	t.Helper()
	var base string
	testwait.Until(t, 0, "serve's listening line", func() bool {
		if m := listeningRE.FindStringSubmatch(stderr.String()); m != nil {
			base = m[1]
			return true
		}
		select {
		case code := <-done:
			t.Fatalf("serve returned %d before it listened; stderr %q", code, stderr.String())
		default:
		}
		return false
	})
	return base
}

func TestRunCLIServe(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stdout bytes.Buffer
	var stderr syncBuffer
	done := make(chan int)
	go func() {
		done <- runCLI(ctx, []string{"serve", "--addr", "127.0.0.1:0"}, envOf(map[string]string{"PAYMENTS_API_KEY": "sk_test_cli"}), &stdout, &stderr)
	}()
	base := listening(t, &stderr, done)
	c := payments.NewClient(payments.ClientConfig{BaseURL: base, APIKey: "sk_test_cli"})
	ch, err := c.Charge(context.Background(), payments.ChargeRequest{Amount: 100, Currency: "eur", IdempotencyKey: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if ch.Status != payments.StatusSucceeded {
		t.Errorf("status = %q", ch.Status)
	}
	// The env key is the only one accepted.
	req, _ := http.NewRequest(http.MethodGet, base+"/v1/payment_intents", nil)
	req.Header.Set("Authorization", "Bearer sk_test_other")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("another key: status %d, want 401", resp.StatusCode)
	}

	cancel()
	select {
	case code := <-done:
		if code != ExitOK {
			t.Errorf("exit code = %d, want 0; stderr %s", code, stderr.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("serve did not stop")
	}
}

func TestRunCLIServeAddrInUse(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr syncBuffer
	done := make(chan int)
	go func() {
		done <- runCLI(ctx, []string{"serve", "--addr", "127.0.0.1:0"}, envOf(nil), new(bytes.Buffer), &stderr)
	}()
	addr := strings.TrimPrefix(listening(t, &stderr, done), "http://")
	var out bytes.Buffer
	if code := runCLI(ctx, []string{"serve", "--addr", addr}, envOf(nil), new(bytes.Buffer), &out); code != ExitFailure {
		t.Errorf("second serve on %s: exit code = %d, want %d; %s", addr, code, ExitFailure, out.String())
	}
	cancel()
	<-done
}

func TestParseServeHelp(t *testing.T) {
	if _, err := parseServe([]string{"--help"}, envOf(nil)); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("parseServe(--help) = %v, want flag.ErrHelp", err)
	}
}
