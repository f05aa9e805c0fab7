package ordersapp

// Second reading of 5bcb404: a gateway whose every answer is slower than
// the key lease, on the refund path (the only call to the gateway made
// with the order's transaction open). Compared with the same run where
// the URL turns the new setting off (idle_in_transaction_session_timeout=0,
// the behaviour before the commit).

import (
	"net/http"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/faultproxy"
	"github.com/idem-go/idem/internal/pgtest"
)

// TestIdleTimeoutSlowGatewayRefundConverges: lease 2s, the order refused for
// good, every answer of the gateway delayed 2.5 s (so each refund call
// keeps the order's transaction idle 2.5 s). One client retries the key
// for up to 45 s (after 503, 502 and 409); the completer runs too. The
// key must end with its final 422 stored.
func TestIdleTimeoutSlowGatewayRefundConverges(t *testing.T) {
	// Waits on a gateway slowed to 2.5s an answer: it runs beside the
	// package's other long waiters (t.Parallel).
	t.Parallel()
	t.Run("setting-off-in-url", func(t *testing.T) { slowGatewayRefund(t, true) })
	t.Run("default", func(t *testing.T) { slowGatewayRefund(t, false) })
}

func slowGatewayRefund(t *testing.T, off bool) {
	db := pgtest.Database(t)
	c := faultNewChain(t, db)
	gw := faultproxy.New(t, "idlerev-gw", faultHostPort(t, c.payURL))
	dbURL := db
	if off {
		dbURL = withURLQuery(t, db, "idle_in_transaction_session_timeout", "0")
	}
	base := faultAddInstance(t, c, dbURL, gw.URL(c.payURL), "--key-lease", "2s")
	pgExec(t, db,
		`CREATE FUNCTION idlerev_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.items::text LIKE '%REFUSED%' THEN
				RAISE EXCEPTION 'idlerev: refused for good' USING ERRCODE = '23514';
			END IF;
			RETURN NEW;
		END $$`,
		`CREATE TRIGGER idlerev_refuse BEFORE INSERT ON orders FOR EACH ROW EXECUTE FUNCTION idlerev_refuse()`,
	)
	remove, err := gw.Latency(faultproxy.Downstream, 2500*time.Millisecond, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer remove()

	const user, key = "idlerev-user", "idlerev-slow-gw"
	body := `{"items":[{"sku":"REFUSED","quantity":1,"unit_price":1000}],"currency":"EUR"}`
	counts := map[int]int{}
	final := 0
	for deadline := time.Now().Add(45 * time.Second); time.Now().Before(deadline); {
		s, _ := postBody(t, base, user, key, body)
		counts[s]++
		if s == http.StatusUnprocessableEntity {
			final = s
			break
		}
		time.Sleep(500 * time.Millisecond) // a client's pause between retries, until its answer or the deadline
	}
	status, attempts := keyStatus(t, db, user, key)
	orders := countRows(t, db, `SELECT count(*) FROM orders`)
	t.Logf("setting off in the URL: %v; answers %v; key stored %d after %d attempts; orders %d; metrics: fenced %d, store errors %d",
		off, counts, status, attempts, orders, faultMetric(t, base, "idem_fenced_total"), faultMetric(t, base, "idem_store_errors_total"))
	if final != http.StatusUnprocessableEntity || status != http.StatusUnprocessableEntity {
		t.Errorf("after 45 s of retries the key has no final answer (answers %v, stored %d after %d attempts): the refund path never stores its 422", counts, status, attempts)
	}
	if orders != 0 {
		t.Errorf("%d orders written for a refused order", orders)
	}
}
