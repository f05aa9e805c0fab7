package ordersapp

// Second reading of 5bcb404: the one place where the order handler's
// transaction is open across a call to the gateway is refundUnwritable
// (the database refused the order for good, inside the request's
// transaction, and the payment is refunded before the final 422 is
// stored). With a refund slower than the sessions'
// idle_in_transaction_session_timeout, the server ended that transaction
// while the refund ran.

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestIdleTimeoutKeepsSlowRefundTransaction: the order refused for good
// (23514 from a trigger), and the gateway's refund takes refundTime (a
// trigger sleeping in the in-process gateway's own transaction). The
// order's transaction sits idle in transaction for that long, longer than
// the idle_in_transaction_session_timeout of the service's sessions
// (idleTimeout). Before the handler kept its transaction for the refund
// (orders.TxKeeper) the server ended it after idleTimeout and the attempt
// that refunded answered 503; now the first attempt stores and answers the
// 422 naming the payment. Every retry replays that 422; one payment, one
// refund of it in full, no order.
//
// The idle timeout is set in the URL, apart from the key lease, which is
// longer than the whole attempt (above the payment timeout, 20 s, as the
// contract asks of a lease), so nothing may take the key from the first
// attempt while it refunds. Serve's default idle timeout is the lease
// itself; with a lease as short as idleTimeout the attempt would outlive
// its lease, and the completer (a scan every 2 s) would take the key over
// whenever a scan fell between the lease's end and the attempt's commit:
// the first attempt, fenced, would answer 409 (one payment and one refund
// all the same), depending on timing alone.
func TestIdleTimeoutKeepsSlowRefundTransaction(t *testing.T) {
	const (
		idleTimeout = 2 * time.Second
		refundTime  = 3500 * time.Millisecond
		keyLease    = 30 * time.Second
	)
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
	withIdleTimeout := func(db string) string {
		return withURLQuery(t, db, "idle_in_transaction_session_timeout", strconv.FormatInt(idleTimeout.Milliseconds(), 10))
	}
	db, _, base := serveOnPGURL(t, setup, withIdleTimeout, "--key-lease", keyLease.String())
	// The gateway's schema exists once serve started.
	pgExec(t, db,
		fmt.Sprintf(`CREATE FUNCTION public.idlerev_slow_refund() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			PERFORM pg_sleep(%g);
			RETURN NEW;
		END $$`, refundTime.Seconds()),
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
