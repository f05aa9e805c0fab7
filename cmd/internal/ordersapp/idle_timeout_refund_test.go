package ordersapp

// Second reading of 5bcb404: the one place where the order handler's
// transaction is open across a call to the gateway is refundUnwritable
// (the database refused the order for good, inside the request's
// transaction, and the payment is refunded before the final 422 is
// stored). With a refund slower than the lease, the server now ends that
// transaction while the refund runs.

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// TestIdleTimeoutKeepsSlowRefundTransaction: lease 2s, the order refused for
// good (23514 from a trigger), and the gateway's refund takes 3.5 s (a
// trigger sleeping in the in-process gateway's own transaction, on its
// own pool, which has no idle timeout). The order's transaction sits idle
// in transaction for those 3.5 s, longer than the lease that the
// service's sessions take as their idle_in_transaction_session_timeout.
// Before the handler kept its transaction for the refund (orders.TxKeeper)
// the server ended it after 2 s and the attempt that refunded answered
// 503; now the first attempt stores and answers the 422 naming the
// payment. Every retry replays that 422; one payment, one refund of it in
// full, no order.
func TestIdleTimeoutKeepsSlowRefundTransaction(t *testing.T) {
	setup := []string{
		`CREATE FUNCTION idlerev_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.items::text LIKE '%REFUSED%' THEN
				RAISE EXCEPTION 'idlerev: refused for good' USING ERRCODE = '23514';
			END IF;
			RETURN NEW;
		END $$`,
		`CREATE TRIGGER idlerev_refuse BEFORE INSERT ON orders FOR EACH ROW EXECUTE FUNCTION idlerev_refuse()`,
	}
	db, _, base := serveOnPG(t, setup, "--key-lease", "2s")
	// The gateway's schema exists once serve started.
	pgExec(t, db,
		`CREATE FUNCTION public.idlerev_slow_refund() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			PERFORM pg_sleep(3.5);
			RETURN NEW;
		END $$`,
		`CREATE TRIGGER idlerev_slow_refund BEFORE INSERT ON payments.refunds FOR EACH ROW EXECUTE FUNCTION public.idlerev_slow_refund()`,
	)
	const user, key = "idlerev-user", "idlerev-slow-refund"
	body := `{"items":[{"sku":"REFUSED","quantity":1,"unit_price":1000}],"currency":"EUR"}`

	final, finalBody := postBody(t, base, user, key, body)
	if final != http.StatusUnprocessableEntity {
		t.Fatalf("first attempt: %d %s; want the 422 (the transaction is kept for the refund)", final, finalBody)
	}
	var p struct {
		Type      string `json:"type"`
		PaymentID string `json:"payment_id"`
	}
	if err := json.Unmarshal([]byte(finalBody), &p); err != nil || p.PaymentID == "" || !strings.Contains(p.Type, "not-writable") {
		t.Fatalf("422 body %s: want order-not-writable with its payment_id (%v)", finalBody, err)
	}
	for i := 0; i < 3; i++ {
		if s, b := postBody(t, base, user, key, body); s != final || b != finalBody {
			t.Errorf("replay %d: %d %s; want the stored 422 %s", i, s, b, finalBody)
		}
	}
	if status, attempts := keyStatus(t, db, user, key); status != http.StatusUnprocessableEntity {
		t.Errorf("key stored %d after %d attempts; want 422", status, attempts)
	} else {
		t.Logf("key stored 422 after %d attempts", attempts)
	}
	pis := countRows(t, db, `SELECT count(*) FROM payments.payment_intents`)
	full := countRows(t, db, `SELECT count(*) FROM payments.payment_intents WHERE amount_refunded = amount_received AND amount_received > 0`)
	refunds := countRows(t, db, `SELECT count(*) FROM payments.refunds`)
	orders := countRows(t, db, `SELECT count(*) FROM orders`)
	t.Logf("payments %d (refunded in full %d), refunds %d, orders %d", pis, full, refunds, orders)
	if pis != 1 || full != 1 || refunds != 1 || orders != 0 {
		t.Errorf("want 1 payment refunded in full by 1 refund and no order; got payments %d (refunded in full %d), refunds %d, orders %d", pis, full, refunds, orders)
	}
	if n := countRows(t, db, `SELECT count(*) FROM payments.payment_intents WHERE id = '`+strings.ReplaceAll(p.PaymentID, "'", "")+`'`); n != 1 {
		t.Errorf("the 422's payment %s is not the gateway's payment", p.PaymentID)
	}
}
