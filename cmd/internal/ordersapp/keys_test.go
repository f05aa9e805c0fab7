package ordersapp

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
)

// opsFlakyPayer fails every payment while down is set, as a gateway that
// is unreachable: the order handler answers 502 and stores nothing.
type opsFlakyPayer struct {
	orders.Payer
	down atomic.Bool
	pays atomic.Int64 // payments attempted while up
}

func (p *opsFlakyPayer) Pay(ctx context.Context, req orders.PaymentRequest) (orders.PaymentResult, error) {
	if p.down.Load() {
		return orders.PaymentResult{}, errors.New("ops test: the gateway is down")
	}
	p.pays.Add(1)
	return p.Payer.Pay(ctx, req)
}

// TestKeysRedriveEndToEnd: the gateway is down; an order's first
// attempt fails (502) and the completer, with serve's budget, re-drives it
// until it gives it up. `orders keys list --state given-up` and `keys
// show` show it; `keys redrive` hands it back (and refuses a second time);
// once the gateway works the completer finishes it: one order, one
// payment, and the audit is clean. On SQLite, and on PostgreSQL when
// TEST_DATABASE_URL is set.
func TestKeysRedriveEndToEnd(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) { opsRedriveEndToEnd(t, "") })
	t.Run("postgres", func(t *testing.T) { opsRedriveEndToEnd(t, pgtest.Database(t)) })
}

func opsRedriveEndToEnd(t *testing.T, dbURL string) {
	ctx := context.Background()
	dir := t.TempDir()
	c := Config{DataDir: dir, DatabaseURL: dbURL, JWTSecret: testSecret, KeyTTL: 24 * time.Hour, KeyLease: 5 * time.Second,
		PaymentsKey: "sk_test_local", RequireKey: true}
	be, err := openBackend(ctx, &c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.close() })
	p, _, err := newPayer(ctx, &c, be)
	if err != nil {
		t.Fatal(err)
	}
	flaky := &opsFlakyPayer{Payer: p}
	flaky.down.Store(true)
	quiet := slog.New(slog.DiscardHandler)
	cfg := orders.Config{Repo: be.repo, Payer: flaky, Idem: be.store, Secret: []byte(testSecret),
		IdemOptions: idem.Options{TTL: c.KeyTTL, Lease: c.KeyLease, MaxStoredBody: orders.MaxStoredResponse, Stored: orders.StoredStatus},
		Logger:      quiet, PaymentKeyRetention: payments.DefaultKeyRetention}
	hs := httptest.NewServer(orders.NewHandler(cfg))
	defer hs.Close()
	const user, key = "ops-alice", "ops-key-1"
	if s, b := postBody(t, hs.URL, user, key, orderBody(1)); s != http.StatusBadGateway {
		t.Fatalf("first attempt with the gateway down: %d %s; want 502", s, b)
	}

	// serve's completer, but for its backoff (1ms instead of 1s..1m), so
	// that its 20 re-drives take milliseconds.
	comp := idem.NewCompleter(be.store, orders.NewCreateHandler(cfg), idem.CompleterOptions{
		Backoff: time.Millisecond, MaxBackoff: time.Millisecond, Middleware: cfg.IdemOptions, Logger: quiet})
	var total idem.CompleterStats
	for deadline := time.Now().Add(time.Minute); total.GivenUp == 0 && time.Now().Before(deadline); {
		st, err := comp.RunOnce(ctx)
		if err != nil {
			t.Fatalf("RunOnce: %v", err)
		}
		total.Scanned += st.Scanned
		total.Completed += st.Completed
		total.Failed += st.Failed
		total.GivenUp += st.GivenUp
		if st.Scanned == 0 {
			time.Sleep(time.Millisecond) // not waiting for an outcome: the database's clock passes the key's 1ms backoff
		}
	}
	if total.GivenUp != 1 || total.Failed != keysBudget || total.Completed != 0 {
		t.Fatalf("completer: %+v; want %d failed re-drives, then given up", total, keysBudget)
	}
	if st, err := comp.RunOnce(ctx); err != nil || st.Scanned != 0 {
		t.Fatalf("scan after giving up: %+v, %v; want nothing listed", st, err)
	}

	keys := func(args ...string) (int, string, string) {
		t.Helper()
		return run(t, nil, append(append([]string{"keys"}, args...), "--data-dir", dir, "--database-url", dbURL)...)
	}
	code, out, errs := keys("list", "--state", "given-up")
	t.Logf("orders keys list --state given-up:\n%s", out)
	if code != 0 || !opsHasLine(out, user, key, "given-up", "21", "20") {
		t.Fatalf("keys list --state given-up: exit %d\n%s%s\nwant a line for %s %s: given-up, 21 attempts, 20 re-drives", code, out, errs, user, key)
	}
	if code, out, _ := keys("list", "--state", "abandoned"); code != 0 || strings.TrimSpace(out) != "no abandoned keys" {
		t.Errorf("keys list --state abandoned: exit %d\n%s", code, out)
	}
	code, out, errs = keys("show", "--user", user, "--key", key)
	t.Logf("orders keys show (given up):\n%s", out)
	for _, want := range []string{"state:         given-up", "attempts:      21 (re-drives by the completer: 20 of 20)",
		"stored status: none", "order:         none (ord_", "request:       POST /v1/orders"} {
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("keys show: exit %d, want %q in:\n%s%s", code, want, out, errs)
		}
	}
	v := opsShowJSON(t, keys, user, key)
	if v.State != "given-up" || v.Attempts != 21 || v.Redrives != 20 || v.MaxRedrives != 20 || v.Order != nil ||
		v.StoredStatus != nil || v.OrderID != orders.OrderID(user, key, v.CreatedAt) {
		t.Errorf("keys show --json = %+v; want given up, no order, order id of the operation", v)
	}

	code, out, errs = keys("redrive", "--user", user, "--key", key)
	t.Logf("orders keys redrive:\n%s", out)
	if code != 0 || !strings.Contains(out, "given up after 20 re-drives") {
		t.Fatalf("keys redrive: exit %d\n%s%s", code, out, errs)
	}
	if code, out, errs := keys("redrive", "--user", user, "--key", key); code != 1 || !strings.Contains(errs, "refused") ||
		!strings.Contains(errs, "is abandoned") || strings.Count(strings.TrimSpace(errs), "\n") != 0 {
		t.Errorf("second keys redrive: exit %d\n%s%s\nwant exit 1, one line: refused, abandoned", code, out, errs)
	}
	if code, out, errs := keys("redrive", "--user", user, "--key", "ops-none"); code != 1 || !strings.Contains(errs, "has no key") {
		t.Errorf("keys redrive of an unknown key: exit %d\n%s%s", code, out, errs)
	}
	if w := opsShowJSON(t, keys, user, key); w.State != "abandoned" || w.Redrives != 0 || w.Attempts != 21 ||
		!w.LeaseUntil.Equal(v.LeaseUntil) || !w.CreatedAt.Equal(v.CreatedAt) || w.Fingerprint != v.Fingerprint {
		t.Errorf("after keys redrive: %+v; want abandoned, 0 re-drives, the same attempts, lease and operation as %+v", w, v)
	}

	flaky.down.Store(false)
	if st, err := comp.RunOnce(ctx); err != nil || st.Completed != 1 {
		t.Fatalf("scan after the redrive, the gateway up: %+v, %v; want it completed", st, err)
	}
	if st, err := comp.RunOnce(ctx); err != nil || st.Scanned != 0 {
		t.Errorf("scan once completed: %+v, %v; want nothing listed", st, err)
	}
	done := opsShowJSON(t, keys, user, key)
	if done.State != "completed" || done.StoredStatus == nil || *done.StoredStatus != http.StatusCreated ||
		done.Order == nil || done.Order.ID != v.OrderID || done.Order.Status != "paid" ||
		!strings.HasPrefix(done.Order.PaymentID, "pi_") || done.CompletedAt == nil {
		t.Errorf("keys show once completed = %+v (order %+v); want completed, 201, order %s paid", done, done.Order, v.OrderID)
	}
	code, out, _ = keys("show", "--user", user, "--key", key)
	t.Logf("orders keys show (completed):\n%s", out)
	if code != 0 || !strings.Contains(out, "order:         "+v.OrderID+": paid") || !strings.Contains(out, "stored status: 201") {
		t.Errorf("keys show once completed: exit %d\n%s", code, out)
	}
	code, out, _ = keys("list", "--state", "completed")
	t.Logf("orders keys list --state completed:\n%s", out)
	if code != 0 || !opsHasLine(out, user, key, "completed") {
		t.Errorf("keys list --state completed: exit %d\n%s", code, out)
	}
	if code, _, errs := keys("redrive", "--user", user, "--key", key); code != 1 || !strings.Contains(errs, "is completed") {
		t.Errorf("keys redrive of a completed key: exit %d %s", code, errs)
	}

	// One order, one payment; the client's retry replays the order.
	list, _, err := be.repo.List(ctx, user, 10, "")
	if err != nil || len(list) != 1 || list[0].ID != v.OrderID {
		t.Errorf("orders of %s = %+v, %v; want the one order %s", user, list, err, v.OrderID)
	}
	if n := flaky.pays.Load(); n != 1 {
		t.Errorf("payments attempted with the gateway up = %d, want 1", n)
	}
	succeeded := 0
	for ch, err := range p.c.All(ctx) {
		if err != nil {
			t.Fatal(err)
		}
		if ch.Status == "succeeded" {
			succeeded++
		}
	}
	if succeeded != 1 {
		t.Errorf("succeeded payments = %d, want 1", succeeded)
	}
	if s, b := postBody(t, hs.URL, user, key, orderBody(1)); s != http.StatusCreated || !strings.Contains(b, v.OrderID) {
		t.Errorf("client's retry: %d %s; want the stored 201 with %s", s, b, v.OrderID)
	}
	code, out, errs = run(t, nil, "audit", "--data-dir", dir, "--database-url", dbURL)
	if code != 0 || !strings.Contains(out, "violations:        0") || !strings.Contains(out, "given up:          0") {
		t.Errorf("audit: exit %d\n%s%s", code, out, errs)
	}
}

// opsShowJSON runs `orders keys show --json` and decodes its answer.
func opsShowJSON(t *testing.T, keys func(...string) (int, string, string), user, key string) keyView {
	t.Helper()
	code, out, errs := keys("show", "--user", user, "--key", key, "--json")
	var v keyView
	if code != 0 {
		t.Fatalf("keys show --json: exit %d\n%s%s", code, out, errs)
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("keys show --json: %v\n%s", err, out)
	}
	return v
}

// opsHasLine reports whether a line of out has the fields want, in order,
// as its first fields.
func opsHasLine(out string, want ...string) bool {
	for line := range strings.SplitSeq(out, "\n") {
		f := strings.Fields(line)
		if len(f) >= len(want) && strings.Join(f[:len(want)], " ") == strings.Join(want, " ") {
			return true
		}
	}
	return false
}

// TestKeysUsage: usage errors exit 2 with one line; --help tells the
// flags and their environment variables; the flag wins over the
// environment.
func TestKeysUsage(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name string
		env  map[string]string
		args []string
	}{
		{"no subcommand", nil, []string{"keys"}},
		{"unknown subcommand", nil, []string{"keys", "drop"}},
		{"list without state", nil, []string{"keys", "list", "--data-dir", dir}},
		{"list bad state", nil, []string{"keys", "list", "--state", "stuck", "--data-dir", dir}},
		{"list bad state env", map[string]string{"ORDERS_KEYS_STATE": "stuck"}, []string{"keys", "list", "--data-dir", dir}},
		{"list limit 0", nil, []string{"keys", "list", "--state", "completed", "--limit", "0", "--data-dir", dir}},
		{"list limit too large", nil, []string{"keys", "list", "--state", "completed", "--limit", "10001", "--data-dir", dir}},
		{"list bad limit env", map[string]string{"ORDERS_KEYS_LIMIT": "many"}, []string{"keys", "list", "--state", "completed", "--data-dir", dir}},
		{"show without user", nil, []string{"keys", "show", "--key", "k", "--data-dir", dir}},
		{"show without key", nil, []string{"keys", "show", "--user", "u", "--data-dir", dir}},
		{"show bad json env", map[string]string{"ORDERS_KEYS_JSON": "perhaps"}, []string{"keys", "show", "--user", "u", "--key", "k"}},
		{"redrive without key", nil, []string{"keys", "redrive", "--user", "u", "--data-dir", dir}},
		{"redrive unknown flag", nil, []string{"keys", "redrive", "--user", "u", "--key", "k", "--force"}},
		{"stray argument", nil, []string{"keys", "list", "--state", "completed", "extra"}},
		{"bad database url", nil, []string{"keys", "list", "--state", "completed", "--database-url", "mysql://x"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errs := run(t, tc.env, tc.args...)
			if code != 2 || out != "" || strings.Count(errs, "\n") != 1 {
				t.Errorf("exit %d, stdout %q, stderr %q; want 2 and one line on stderr", code, out, errs)
			}
		})
	}
	code, out, _ := run(t, nil, "keys", "--help")
	for _, want := range []string{"show", "list", "redrive", "given-up", "in-flight", "abandoned", "completed"} {
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("keys --help: exit %d, want %q in:\n%s", code, want, out)
		}
	}
	if code, out, _ := run(t, nil, "--help"); code != 0 || !strings.Contains(out, "keys ") {
		t.Errorf("orders --help does not list keys: exit %d\n%s", code, out)
	}
	for sub, wants := range map[string][]string{
		"show":    {"--user", "ORDERS_KEYS_USER", "--key", "ORDERS_KEYS_KEY", "--json", "ORDERS_KEYS_JSON", "DATABASE_URL", "ORDERS_DATA_DIR"},
		"list":    {"--state", "ORDERS_KEYS_STATE", "--limit", "ORDERS_KEYS_LIMIT", "default 100", "--json", "DATABASE_URL"},
		"redrive": {"--user", "ORDERS_KEYS_USER", "--key", "ORDERS_KEYS_KEY", "DATABASE_URL"},
	} {
		code, out, _ := run(t, nil, "keys", sub, "--help")
		for _, want := range wants {
			if code != 0 || !strings.Contains(out, want) {
				t.Errorf("keys %s --help: exit %d, want %q in:\n%s", sub, code, want, out)
			}
		}
	}
	// The environment sets a flag; the flag wins. The keys commands open
	// an existing database only: make an empty one.
	be, err := openBackend(context.Background(), &Config{DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	be.close()
	env := map[string]string{"ORDERS_DATA_DIR": dir, "ORDERS_KEYS_STATE": "bogus"}
	if code, out, errs := run(t, env, "keys", "list", "--state", "given-up"); code != 0 || strings.TrimSpace(out) != "no given-up keys" {
		t.Errorf("keys list with a bad ORDERS_KEYS_STATE and --state given-up: exit %d\n%s%s", code, out, errs)
	}
	env["ORDERS_KEYS_STATE"] = "in-flight"
	if code, out, errs := run(t, env, "keys", "list"); code != 0 || strings.TrimSpace(out) != "no in-flight keys" {
		t.Errorf("keys list with ORDERS_KEYS_STATE=in-flight: exit %d\n%s%s", code, out, errs)
	}
	if code, out, errs := run(t, env, "keys", "list", "--json"); code != 0 || strings.TrimSpace(out) != "[]" {
		t.Errorf("keys list --json of no keys: exit %d\n%s%s", code, out, errs)
	}
}
