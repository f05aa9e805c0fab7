package ordersapp

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/internal/pgtest"
)

// runBriefly runs the orders command with env for at most two seconds
// (a serve that is not refused stops then) and returns its exit status
// and stderr.
func runBriefly(t *testing.T, env map[string]string, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var out, errb syncBuffer
	a := &App{Stdout: &out, Stderr: &errb, Getenv: func(k string) string { return env[k] }}
	return a.Run(ctx, args), errb.String()
}

// TestServeRefusesBadPaymentsKey: a --payments-key that no gateway
// accepts (empty, or with a space or a control character, by the flag or
// PAYMENTS_API_KEY) is refused at start with exit 2 and one line that
// names the flag and does not repeat the secret; serve never starts to
// answer every order 502.
func TestServeRefusesBadPaymentsKey(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		args []string
	}{
		{"empty flag", nil, []string{"--payments-key="}},
		{"empty flag, separate", nil, []string{"--payments-key", ""}},
		{"space", nil, []string{"--payments-key", "sk_test_ a"}},
		{"newline", nil, []string{"--payments-key", "sk_test_a\nb"}},
		{"env with a space", map[string]string{"PAYMENTS_API_KEY": "sk_test_a b"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"serve", "--addr", freeAddr(t), "--data-dir", t.TempDir(), "--jwt-secret", testSecret}, tc.args...)
			code, stderr := runBriefly(t, tc.env, args...)
			if code != 2 {
				t.Fatalf("exit %d, want 2\n%s", code, stderr)
			}
			if lines := strings.Count(strings.TrimRight(stderr, "\n"), "\n"); lines != 0 || !strings.Contains(stderr, "--payments-key") {
				t.Errorf("stderr %q: want one line naming --payments-key", stderr)
			}
			if strings.Contains(stderr, "sk_test_a") {
				t.Errorf("stderr %q repeats the secret", stderr)
			}
		})
	}
}

// TestEmptyPaymentsKeyRefusedAtStart (review finding 8, moved from review_test.go):
// `orders serve --payments-key=` either exits 2 or works; it exits 2.
func TestEmptyPaymentsKeyRefusedAtStart(t *testing.T) {
	dir := t.TempDir()
	addr := freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errb syncBuffer
	a := &App{Stdout: &out, Stderr: &errb, Getenv: func(string) string { return "" }}
	done := make(chan int, 1)
	go func() {
		done <- a.Run(ctx, []string{"serve", "--addr", addr, "--data-dir", dir, "--jwt-secret", testSecret, "--payments-key="})
	}()
	for i := 0; i < 200; i++ {
		select {
		case code := <-done:
			if code != 2 {
				t.Fatalf("serve --payments-key=: exit %d, want 2 or a working service\n%s", code, errb.String())
			}
			return
		default:
		}
		if resp, err := http.Get("http://" + addr + "/healthz"); err == nil {
			resp.Body.Close()
			break
		}
		time.Sleep(25 * time.Millisecond) // a poll with a deadline (200 tries): ends as soon as serve answers or exits
	}
	if s, b := postBody(t, "http://"+addr, "u", "k-empty-key", orderBody(1)); s != http.StatusCreated {
		t.Errorf("serve --payments-key= started, and a valid order is answered %d %s (every order will be)", s, b)
	}
	cancel()
	<-done
}

// TestTokenRefusesBadUser: `orders token --user` with a user id that the
// API would refuse (NUL, another control character, over 255 bytes)
// exits 2 with one line, and prints no token.
func TestTokenRefusesBadUser(t *testing.T) {
	dir := t.TempDir()
	for _, u := range []string{"eve\x00", "eve\n", "eve\x7f", strings.Repeat("u", 256)} {
		code, out, stderr := run(t, nil, "token", "--data-dir", dir, "--user", u)
		if code != 2 || out != "" {
			t.Errorf("token --user %.20q: exit %d, stdout %q; want 2 and no token", u, code, out)
		}
		if lines := strings.Count(strings.TrimRight(stderr, "\n"), "\n"); lines != 0 {
			t.Errorf("token --user %.20q: stderr %q, want one line", u, stderr)
		}
	}
	if code, out, stderr := run(t, nil, "token", "--data-dir", dir, "--user", "Zoë"); code != 0 || out == "" {
		t.Errorf("token --user Zoë: exit %d %q %q", code, out, stderr)
	}
}

// TestGCCleansInProcessGatewayKeys (review finding 3, moved from
// review_test.go): `orders gc` deletes the in-process gateway's expired
// keys as well as the order store's, and prints both counts.
func TestGCCleansInProcessGatewayKeys(t *testing.T) {
	ordersBin, _ := binaries(t)
	db, dir := pgtest.Database(t), t.TempDir()
	if code, out, errs := run(t, nil, "migrate", "--database-url", db, "--data-dir", dir); code != 0 {
		t.Fatalf("migrate: %d %s %s", code, out, errs)
	}
	addr := freeAddr(t)
	// --consume=false: the receipts consumer's keys (one per order) would
	// be counted with the orders'.
	start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", dir, "--database-url", db, "--jwt-secret", testSecret, "--consume=false")
	base := "http://" + addr
	for i := 0; i < 3; i++ {
		if s, b := postBody(t, base, "gc-user", "gc-"+string(rune('a'+i)), orderBody(i)); s != http.StatusCreated {
			t.Fatalf("order %d: %d %s", i, s, b)
		}
	}
	// Past every retention: the order keys' and the gateway's.
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	for _, q := range []string{
		`UPDATE public.idempotency_keys SET expires_at = now() - interval '1 hour'`,
		`UPDATE payments.idempotency_keys SET expires_at = now() - interval '1 hour'`,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	code, out, errs := run(t, nil, "gc", "--database-url", db, "--data-dir", dir)
	if code != 0 {
		t.Fatalf("gc: %d %s %s", code, out, errs)
	}
	if !strings.Contains(out, "deleted 3 expired keys in") || !strings.Contains(out, "deleted 3 expired keys of the in-process gateway") {
		t.Errorf("gc printed %q; want both counts (3 order keys, 3 gateway keys)", out)
	}
	if n := countRows(t, db, `SELECT count(*) FROM public.idempotency_keys`); n != 0 {
		t.Errorf("%d order keys left after gc", n)
	}
	if n := countRows(t, db, `SELECT count(*) FROM payments.idempotency_keys`); n != 0 {
		t.Errorf("%d expired in-process gateway keys left after orders gc; want 0", n)
	}
}
