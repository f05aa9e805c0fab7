package ordersapp

import (
	"database/sql"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

// TestKeysRedriveFinishesPaidOrder: the operator's path end to end. An
// order's payment succeeds at the gateway but its answer is lost, so the
// order is not made; the completers give the key up. `orders audit` then
// reports a payment without its order. `orders keys redrive`, run beside
// a running serve (its own handle on the SQLite file), hands the key back;
// serve's completer finishes it with the same payment (the gateway
// replays it), and the audit is clean: one order, one payment, and the
// client's retry replays the order.
func TestKeysRedriveFinishesPaidOrder(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("end to end, a few seconds")
	}
	dir := t.TempDir()
	quiet := slog.New(slog.DiscardHandler)
	st, ledger := memstore.New(memstore.Options{}), payments.NewMemLedger()
	gateway := payments.NewServer(payments.Config{APIKey: "sk_test_local", Store: st, Ledger: ledger, Logger: quiet})
	// ok: every answer reaches the service. Before it, the answers to
	// POSTs are lost, and so are those to GETs while the first serve runs:
	// its completer may re-drive the key before it stops (a loaded
	// machine), and its attempt would find the payment by the gateway's
	// search and make the order that this test wants missing. The audit
	// in between lists the payments with GETs.
	var ok, firstServeDone atomic.Bool
	gw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if ok.Load() || (r.Method != http.MethodPost && firstServeDone.Load()) {
			gateway.ServeHTTP(w, r)
			return
		}
		// The gateway carries the request out (a charge, the replay of
		// one, a search), and its answer is lost on the way back.
		gateway.ServeHTTP(httptest.NewRecorder(), r)
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	defer gw.Close()
	c := Config{DataDir: dir, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: 30 * time.Second,
		PaymentsKey: "sk_test_local", PaymentsURL: gw.URL, RequireKey: true}

	srv := startInProcess(t, &c)
	status, body := postBody(t, srv.base, "alice", "rdv-paid", orderBody(1))
	srv.stop()
	firstServeDone.Store(true)
	if status < 500 {
		t.Fatalf("the order whose payment answer was lost: %d %s; want a 5xx", status, body)
	}
	db, err := sql.Open("sqlite", filepath.Join(dir, "orders.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`UPDATE idempotency_keys SET redrives = ? WHERE key = 'rdv-paid'`, idem.DefaultCompleterMaxAttempts); err != nil {
		t.Fatal(err)
	}
	code, out, errs := run(t, nil, "audit", "--data-dir", dir, "--payments-url", gw.URL)
	if code != 1 || !strings.Contains(out+errs, "has no order") {
		t.Fatalf("audit before the re-drive: exit %d; want 1, a payment without its order:\n%s%s", code, out, errs)
	}

	ok.Store(true)
	srv = startInProcess(t, &c)
	code, out, errs = run(t, nil, "keys", "show", "--user", "alice", "--key", "rdv-paid", "--data-dir", dir)
	if code != 0 || !strings.Contains(out, "given-up") {
		t.Fatalf("keys show: exit %d, want given-up:\n%s%s", code, out, errs)
	}
	code, out, errs = run(t, nil, "keys", "redrive", "--user", "alice", "--key", "rdv-paid", "--data-dir", dir)
	if code != 0 {
		t.Fatalf("keys redrive: exit %d\n%s%s", code, out, errs)
	}
	var v keyView
	for deadline := time.Now().Add(30 * time.Second); ; {
		code, out, errs = run(t, nil, "keys", "show", "--user", "alice", "--key", "rdv-paid", "--data-dir", dir, "--json")
		if code != 0 || json.Unmarshal([]byte(out), &v) != nil {
			t.Fatalf("keys show --json: exit %d\n%s%s", code, out, errs)
		}
		if v.State == string(idemdriver.KeyCompleted) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the completer did not finish the re-driven key: %s", out)
		}
		time.Sleep(100 * time.Millisecond) // a poll with a deadline (serve's completer scans every 2s)
	}
	if v.StoredStatus == nil || *v.StoredStatus != http.StatusCreated || v.Order == nil || v.Order.Status != "paid" || v.Redrives != 1 {
		t.Errorf("after the re-drive: %s", out)
	}
	status, body = postBody(t, srv.base, "alice", "rdv-paid", orderBody(1))
	if status != http.StatusCreated || !strings.Contains(body, v.OrderID) {
		t.Errorf("the client's retry: %d %s; want the order %s replayed", status, body, v.OrderID)
	}
	srv.stop()
	code, out, errs = run(t, nil, "audit", "--data-dir", dir, "--payments-url", gw.URL)
	if code != 0 || !strings.Contains(out, "orders:            1") || !strings.Contains(out, "payments:          1 (1 succeeded)") {
		t.Errorf("audit after the re-drive: exit %d; want 0, one order, one payment:\n%s%s", code, out, errs)
	}
}
