package ordersapp

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
)

// postBody posts body as user with key and returns the status and body.
func postBody(t *testing.T, base, user, key, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", base+"/v1/orders", strings.NewReader(body))
	tok, err := issue(user)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+tok)
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestAuditAcceptsRefundedPayments: a payment whose order the database
// refused for good is refunded by the service and the audit accepts it; a
// payment without an order refunded only in part is a violation, and so is
// a paid order whose payment was refunded.
func TestAuditAcceptsRefundedPayments(t *testing.T) {
	skipInShort(t, "runs a service, a gateway and the audit")
	ctx := context.Background()
	dir := t.TempDir()
	c := Config{DataDir: dir, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: 30 * time.Second, PaymentsKey: "sk_test_local", RequireKey: true}
	srv, err := (&App{}).newServer(ctx, &c, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	// The schema refuses one sku for good, as no validation foresees.
	db, err := sql.Open("sqlite", filepath.Join(dir, "orders.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := db.Exec(`CREATE TRIGGER test_refused_sku BEFORE INSERT ON orders
		WHEN NEW.items LIKE '%"sku":"REFUSED"%'
		BEGIN SELECT RAISE(ABORT, 'sku REFUSED is refused'); END`); err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.handler)
	for i := 0; i < 2; i++ {
		if s, err := post(http.DefaultClient, hs.URL, "auditor", fmt.Sprintf("audit-%d", i), i); s != http.StatusCreated {
			t.Fatalf("order %d: %d %v", i, s, err)
		}
	}
	refused := `{"items":[{"sku":"REFUSED","quantity":1,"unit_price":700}],"currency":"EUR"}`
	for i := 0; i < 2; i++ { // the answer is final: the retry replays it
		if s, body := postBody(t, hs.URL, "auditor", "refused-1", refused); s != http.StatusUnprocessableEntity || !strings.Contains(body, orders.ProblemOrderNotWritable) {
			t.Fatalf("refused order, attempt %d: %d %s; want 422 %s", i+1, s, body, orders.ProblemOrderNotWritable)
		}
	}
	hs.Close()
	srv.close()

	audit := func() (int, string) {
		t.Helper()
		code, out, errs := run(t, nil, "audit", "--data-dir", dir)
		return code, out + errs
	}
	code, out := audit()
	if code != 0 || !strings.Contains(out, "orders:            2") || !strings.Contains(out, "payments:          3 (3 succeeded)") ||
		!strings.Contains(out, "refunded:          1") || !strings.Contains(out, "OK: every invariant holds") {
		t.Fatalf("audit after a refused order was refunded: exit %d, want 0, 2 orders, 3 payments, 1 refunded\n%s", code, out)
	}

	// Payments made and refunded behind the service's back, through the
	// in-process gateway of the same database.
	be, err := openBackend(ctx, &c)
	if err != nil {
		t.Fatal(err)
	}
	defer be.close()
	p, _, err := newPayer(ctx, &c, be)
	if err != nil {
		t.Fatal(err)
	}
	orphan, err := p.Pay(ctx, orders.PaymentRequest{Amount: 1000, Currency: "EUR", IdempotencyKey: "orphan-1", OrderRef: "ord_orphan"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.c.Refund(ctx, payments.RefundRequest{PaymentIntent: orphan.ID, Amount: 400, IdempotencyKey: "orphan-1-part"}); err != nil {
		t.Fatal(err)
	}
	code, out = audit()
	if code != 1 || !strings.Contains(out, "violations:        1") || !strings.Contains(out, "payment "+orphan.ID+` (order_ref "ord_orphan") has no order and is refunded only in part (400 of 1000)`) {
		t.Errorf("audit of a payment without an order refunded in part: exit %d, want 1 and that violation\n%s", code, out)
	}
	if _, err := p.c.Refund(ctx, payments.RefundRequest{PaymentIntent: orphan.ID, IdempotencyKey: "orphan-1-rest"}); err != nil {
		t.Fatal(err)
	}
	code, out = audit()
	if code != 0 || !strings.Contains(out, "refunded:          2") {
		t.Errorf("audit once the rest was refunded: exit %d, want 0 and 2 refunded\n%s", code, out)
	}

	// A paid order whose payment is refunded is a violation: the order
	// says paid.
	var paid orders.Order
	if err := be.allOrders(ctx, func(o orders.Order) error { paid = o; return nil }); err != nil {
		t.Fatal(err)
	}
	if err := p.Refund(ctx, orders.RefundRequest{PaymentID: paid.PaymentID, IdempotencyKey: "behind-the-back"}); err != nil {
		t.Fatal(err)
	}
	code, out = audit()
	want := fmt.Sprintf("payment %s for order %s is refunded (%d of %d) but the order says paid", paid.PaymentID, paid.ID, paid.Total, paid.Total)
	if code != 1 || !strings.Contains(out, "violations:        1") || !strings.Contains(out, want) {
		t.Errorf("audit of a refunded paid order: exit %d, want 1 and %q\n%s", code, want, out)
	}
}

// TestAuditListsRefundsOnce: the audit lists the gateway's refunds once,
// whatever the number of payments (one call per payment took hours at a
// real gateway's rate limit), still sums each payment's refunds, and
// writes what it read as a progress line on stderr.
func TestAuditListsRefundsOnce(t *testing.T) {
	skipInShort(t, "runs a gateway and the audit")
	ctx := context.Background()
	dir := t.TempDir()
	c := Config{DataDir: dir, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: 30 * time.Second, PaymentsKey: "sk_test_refunds_once"}
	srv, err := (&App{}).newServer(ctx, &c, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	srv.close() // a service's database, without orders

	var mu sync.Mutex
	calls := map[string]int{}
	gw := payments.NewServer(payments.Config{APIKey: c.PaymentsKey, Logger: slog.New(slog.DiscardHandler)})
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls[r.Method+" "+r.URL.Path]++
		mu.Unlock()
		gw.ServeHTTP(w, r)
	}))
	defer hs.Close()
	pc := payments.NewClient(payments.ClientConfig{BaseURL: hs.URL, APIKey: c.PaymentsKey})
	const n = 12
	var refundedInFull string
	for i := range n {
		ch, err := pc.Charge(ctx, payments.ChargeRequest{Amount: 1000, Currency: "eur", PaymentMethod: "pm_card_visa",
			IdempotencyKey: fmt.Sprintf("pay-%d", i), Metadata: map[string]string{"order_ref": fmt.Sprintf("ord_gone_%d", i)}})
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 { // refunded in full, in two parts: no violation
			refundedInFull = ch.ID
			for j, amount := range []int64{300, 700} {
				if _, err := pc.Refund(ctx, payments.RefundRequest{PaymentIntent: ch.ID, Amount: amount, IdempotencyKey: fmt.Sprintf("refund-%d", j)}); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	mu.Lock()
	clear(calls)
	mu.Unlock()

	code, out, errs := run(t, nil, "audit", "--data-dir", dir, "--payments-url", hs.URL, "--payments-key", c.PaymentsKey)
	if code != 1 || !strings.Contains(out, fmt.Sprintf("payments:          %d (%d succeeded)", n, n)) ||
		!strings.Contains(out, "refunded:          1") || !strings.Contains(out, fmt.Sprintf("violations:        %d", n-1)) ||
		strings.Contains(out, refundedInFull) {
		t.Errorf("audit: exit %d; want 1, %d payments, 1 refunded in full (%s, not named), %d violations\n%s%s", code, n, refundedInFull, n-1, out, errs)
	}
	mu.Lock()
	defer mu.Unlock()
	// Two passes: a violation is kept only if a second pass sees it too.
	if got := calls["GET /v1/refunds"]; got != 2 {
		t.Errorf("the audit listed refunds %d times, want 2 (once per pass, not once per payment); calls: %v", got, calls)
	}
	// Every payment's order_ref names an order id of its own: n judged.
	want := fmt.Sprintf("orders audit: read 0 orders, 0 idempotency keys, %d payments, 2 refunds, 0 events in the outbox, 0 stream messages, 0 receipts; judged %d order ids (", n, n)
	if !strings.Contains(errs, want) {
		t.Errorf("stderr has no progress line %q:\n%s", want, errs)
	}
}

// TestAuditSince: --since judges the operations begun at or after it and
// no earlier one, even one whose events and payments it reads.
func TestAuditSince(t *testing.T) {
	skipInShort(t, "runs a service and the audit")
	ctx := context.Background()
	dir := t.TempDir()
	c := Config{DataDir: dir, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: 30 * time.Second, PaymentsKey: "sk_test_local", RequireKey: true}
	srv, err := (&App{}).newServer(ctx, &c, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.handler)
	for i := range 4 {
		if i == 2 {
			time.Sleep(20 * time.Millisecond) // the window starts between the orders 1 and 2
		}
		if s, err := post(http.DefaultClient, hs.URL, "windowed", fmt.Sprintf("since-%d", i), i); s != http.StatusCreated {
			t.Fatalf("order %d: %d %v", i, s, err)
		}
	}
	hs.Close()
	srv.close()

	db, err := sql.Open("sqlite", filepath.Join(dir, "orders.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var ids []string
	var created []string
	rows, err := db.Query(`SELECT id, idempotency_key_created_at FROM orders ORDER BY idempotency_key_created_at`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id, at string
		if err := rows.Scan(&id, &at); err != nil {
			t.Fatal(err)
		}
		ids, created = append(ids, id), append(created, at)
	}
	if err := rows.Err(); err != nil || len(ids) != 4 {
		t.Fatalf("%d orders, %v", len(ids), err)
	}
	k1, err := time.Parse(time.RFC3339Nano, created[1])
	if err != nil {
		t.Fatal(err)
	}
	since := k1.Add(10 * time.Millisecond).Format(time.RFC3339Nano)
	// One order before the window and one in it no longer match their
	// events: a violation each.
	for _, id := range []string{ids[0], ids[3]} {
		if _, err := db.Exec(`UPDATE orders SET total = total + 1 WHERE id = ?`, id); err != nil {
			t.Fatal(err)
		}
	}

	code, out, errs := run(t, nil, "audit", "--data-dir", dir, "--since", since)
	if code != 1 || !strings.Contains(out, "orders:            2\n") || !strings.Contains(out, "idempotency keys:  2 ") ||
		!strings.Contains(out, ids[3]) || strings.Contains(out, ids[0]) || !strings.Contains(out, "order ids outside it") {
		t.Errorf("audit --since %s: exit %d; want 1, 2 orders, 2 keys, a violation of %s and none of %s\n%s%s", since, code, ids[3], ids[0], out, errs)
	}
	code, out, errs = run(t, nil, "audit", "--data-dir", dir)
	if code != 1 || !strings.Contains(out, "orders:            4\n") || !strings.Contains(out, ids[3]) || !strings.Contains(out, ids[0]) {
		t.Errorf("audit: exit %d; want 1, 4 orders, violations of %s and %s\n%s%s", code, ids[0], ids[3], out, errs)
	}
	if code, _, errs := run(t, nil, "audit", "--data-dir", dir, "--since", "yesterday"); code != 2 || !strings.Contains(errs, "RFC 3339") {
		t.Errorf("audit --since yesterday: exit %d, want 2 and a usage error naming RFC 3339\n%s", code, errs)
	}
}
