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
