package ordersapp

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
)

// chain is a standalone gateway and order services on one database and
// one NATS (a test server of its own, natsURL).
type chain struct {
	db, dir  string
	natsURL  string
	payURL   string
	payments *proc
	orders   []*proc
	bases    []string
}

func newChain(t *testing.T, instances int, payArgs []string, orderArgs ...string) *chain {
	t.Helper()
	ordersBin, paymentsBin := binaries(t)
	c := &chain{db: pgtest.Database(t), dir: t.TempDir(), natsURL: testNATS(t)}
	payAddr := freeAddr(t)
	c.payURL = "http://" + payAddr
	c.payments = start(t, c.payURL+"/v1/payment_intents", paymentsBin, append([]string{"serve", "--addr", payAddr}, payArgs...)...)
	for i := 0; i < instances; i++ {
		addr := freeAddr(t)
		args := append([]string{"serve", "--addr", addr, "--data-dir", c.dir, "--database-url", c.db,
			"--jwt-secret", testSecret, "--payments-url", c.payURL, "--nats-url", c.natsURL}, orderArgs...)
		c.orders = append(c.orders, start(t, "http://"+addr+"/healthz", ordersBin, args...))
		c.bases = append(c.bases, "http://"+addr)
	}
	return c
}

// succeededPayments counts the gateway's succeeded PaymentIntents, and how
// many distinct orders they name.
func (c *chain) succeededPayments(t *testing.T) (n, refs int) {
	t.Helper()
	cl := payments.NewClient(payments.ClientConfig{BaseURL: c.payURL, APIKey: "sk_test_local", HTTPClient: &http.Client{}})
	seen := map[string]bool{}
	for ch, err := range cl.All(context.Background()) {
		if err != nil {
			t.Fatal(err)
		}
		if ch.Status == "succeeded" {
			n++
			seen[ch.Metadata["order_ref"]] = true
		}
	}
	return n, len(seen)
}

// wantOneOrderAndPaymentEach checks that the chain holds n orders and
// n succeeded PaymentIntents naming n distinct orders (logged under
// what), and that orders audit finds every invariant.
func (c *chain) wantOneOrderAndPaymentEach(t *testing.T, what string, n int) {
	t.Helper()
	orders := countRows(t, c.db, `SELECT count(*) FROM orders`)
	pis, refs := c.succeededPayments(t)
	t.Logf("%s: %d orders, %d succeeded PaymentIntents for %d distinct orders", what, orders, pis, refs)
	if orders != n || pis != n || refs != n {
		t.Errorf("orders %d, payments %d (%d distinct); want %d each", orders, pis, refs, n)
	}
	c.audit(t)
}

func (c *chain) audit(t *testing.T) string {
	t.Helper()
	ordersBin, _ := binaries(t)
	out, err := exec.Command(ordersBin, "audit", "--database-url", c.db, "--data-dir", c.dir, "--payments-url", c.payURL, "--nats-url", c.natsURL).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "OK: every invariant holds") || !strings.Contains(string(out), "pending:           0") {
		t.Errorf("orders audit: %v\n%s", err, out)
	}
	return string(out)
}

// post sends one order with hc and returns its status, or 0 when the
// request failed in transit.
func post(hc *http.Client, base, user, key string, i int) (int, error) {
	req, _ := http.NewRequest("POST", base+"/v1/orders", strings.NewReader(orderBody(i)))
	tok, _ := issue(user)
	req.Header.Set("Authorization", "Bearer "+tok)
	req.Header.Set("Idempotency-Key", key)
	resp, err := hc.Do(req)
	if err != nil {
		return 0, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, nil
}

func retrying() *http.Client {
	return &http.Client{Transport: &client.Transport{
		MaxAttempts: 40, InitialBackoff: 20 * time.Millisecond, MaxBackoff: 500 * time.Millisecond, MaxElapsed: time.Minute,
	}}
}

// (a) The gateway drops 30% of first attempts after charging. 200 orders
// through the retrying client: 200 orders, exactly 200 PaymentIntents.
func TestDroppedGatewayAnswers(t *testing.T) {
	c := newChain(t, 1, []string{"--fail-after-charge", "0.3"})
	const n = 200
	hc := retrying()
	var wg sync.WaitGroup
	var bad atomic.Int64
	sem := make(chan struct{}, 16)
	for i := 0; i < n; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int) {
			defer func() { <-sem; wg.Done() }()
			if s, err := post(hc, c.bases[0], fmt.Sprintf("drop-user-%d", i%5), fmt.Sprintf("drop-%d", i), i); s != http.StatusCreated {
				bad.Add(1)
				t.Errorf("order %d: %d %v", i, s, err)
			}
		}(i)
	}
	wg.Wait()
	orders := countRows(t, c.db, `SELECT count(*) FROM orders`)
	pis, refs := c.succeededPayments(t)
	dropped := strings.Count(c.payments.logs.String(), "connection dropped after charge")
	t.Logf("(a) dropped answers: %d gateway answers dropped after charging; %d orders, %d succeeded PaymentIntents for %d distinct orders", dropped, orders, pis, refs)
	if orders != n || pis != n || refs != n || bad.Load() != 0 {
		t.Errorf("orders %d, payments %d (%d distinct), failed requests %d; want %d, %d, %d, 0", orders, pis, refs, bad.Load(), n, n, n)
	}
	if dropped == 0 {
		t.Errorf("the gateway dropped no answer; the fault was not exercised")
	}
	c.audit(t)
}

// crashInFlight sends 50 orders to instance 0, waits until each has
// claimed its key and so is on its way to the gateway (1s latency), and
// kills instance 0 with SIGKILL.
func crashInFlight(t *testing.T, c *chain, prefix string) (keys []string) {
	t.Helper()
	return crashInFlightVia(t, c, prefix, func(i int, key string) {
		_, _ = post(&http.Client{Timeout: 10 * time.Second}, c.bases[0], "crash-user", key, i) // dies with the instance
	})
}

// crashInFlightVia is crashInFlight with the orders sent by send (order
// i, with key, to instance 0, as user crash-user).
func crashInFlightVia(t *testing.T, c *chain, prefix string, send func(i int, key string)) (keys []string) {
	t.Helper()
	const n = 50
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		key := fmt.Sprintf("%s-%d", prefix, i)
		keys = append(keys, key)
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			send(i, key)
		}(i)
	}
	// Kill as soon as every request holds its key, long before the gateway
	// (1s) answers any of them.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) { // a poll with a deadline
		// The requests' keys only: the receipts consumer's message ids
		// share the table (and would carry the count past n once orders
		// were written).
		if countRows(t, c.db, `SELECT count(*) FROM idempotency_keys WHERE user_id = 'crash-user'`) >= n {
			break
		}
	}
	c.orders[0].kill()
	wg.Wait()
	if got := countRows(t, c.db, `SELECT count(*) FROM orders`); got != 0 {
		t.Fatalf("%d orders before the gateway answered; the crash came too late", got)
	}
	if got := countRows(t, c.db, `SELECT count(*) FROM idempotency_keys WHERE response_status IS NULL`); got != n {
		t.Fatalf("%d keys claimed and unfinished at the crash, want %d", got, n)
	}
	return keys
}

// (b) kill -9 one of two instances while 50 orders are in flight, then
// retry them all on the other after the lease: one order, one payment each.
func TestCrashThenRetry(t *testing.T) {
	c := newChain(t, 2, []string{"--latency", "1s"}, "--key-lease", "2s")
	keys := crashInFlight(t, c, "retry")
	time.Sleep(2 * time.Second) // not waiting for an outcome: the wall clock of the processes and PostgreSQL passes the killed attempts' lease (2s)
	hc := retrying()
	var wg sync.WaitGroup
	for i, k := range keys {
		wg.Add(1)
		go func(i int, k string) {
			defer wg.Done()
			if s, err := post(hc, c.bases[1], "crash-user", k, i); s != http.StatusCreated {
				t.Errorf("retry of %s: %d %v", k, s, err)
			}
		}(i, k)
	}
	wg.Wait()
	c.wantOneOrderAndPaymentEach(t, "(b) crash then retry", len(keys))
}

// (c) The same crash and nobody retries: the other instance's completer
// alone makes every order. It re-drives the abandoned keys one at a time,
// and a key whose attempt had not paid yet waits the gateway's second
// again, so how long it takes depends on how many the crash caught before
// paying: up to about a second per key. The wait ends when every order is
// written, and fails when the count stops rising for longer than a lease,
// two of the completer's intervals and two gateway calls (the completer
// stalled), or after two minutes. Before, a fixed 20 s caught 43 of 50
// under load (a CI run, 2026-12-05) while the completer was still
// writing one a second.
func TestCrashCompleterAlone(t *testing.T) {
	c := newChain(t, 2, []string{"--latency", "1s"}, "--key-lease", "2s")
	crashed := time.Now()
	keys := crashInFlight(t, c, "alone")
	const stall = 2*time.Second + 2*completerInterval + 2*time.Second + 4*time.Second // lease, two scans, two gateway calls, room
	var orders int
	last, moved := -1, time.Now()
	for time.Since(crashed) < 2*time.Minute && time.Since(moved) < stall {
		if orders = countRows(t, c.db, `SELECT count(*) FROM orders`); orders == len(keys) {
			break
		}
		if orders != last {
			last, moved = orders, time.Now()
		}
		time.Sleep(100 * time.Millisecond) // a poll with a deadline: ends as soon as every order is written
	}
	t.Logf("(c) completer alone: %d orders %v after the crash (lease 2s + interval %v + gateway 1s)",
		orders, time.Since(crashed).Round(10*time.Millisecond), completerInterval)
	c.wantOneOrderAndPaymentEach(t, "(c) completer alone", len(keys))
}

// (d) A lease stolen from a slow attempt (lease 1s, gateway 2s): one order,
// and the slow attempt's commit is refused.
func TestStolenLease(t *testing.T) {
	c := newChain(t, 1, []string{"--latency", "2s"}, "--key-lease", "1s")
	slow := make(chan int)
	go func() {
		s, _ := post(&http.Client{Timeout: 30 * time.Second}, c.bases[0], "slow-user", "stolen", 7)
		slow <- s
	}()
	time.Sleep(1500 * time.Millisecond) // not waiting for an outcome: the real clock passes the lease (1s), not the gateway's 2s
	s, err := post(retrying(), c.bases[0], "slow-user", "stolen", 7)
	if s != http.StatusCreated {
		t.Fatalf("the attempt that took over: %d %v", s, err)
	}
	slowStatus := <-slow
	orders := countRows(t, c.db, `SELECT count(*) FROM orders`)
	pis, _ := c.succeededPayments(t)
	resp, err := http.Get(c.bases[0] + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	m, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var fenced int
	for _, line := range strings.Split(string(m), "\n") {
		if strings.HasPrefix(line, "idem_fenced_total ") {
			if _, err := fmt.Sscan(strings.TrimPrefix(line, "idem_fenced_total "), &fenced); err != nil {
				t.Fatalf("%q: %v", line, err)
			}
		}
	}
	t.Logf("(d) stolen lease: slow attempt answered %d, %d fenced at commit; %d orders, %d succeeded PaymentIntents", slowStatus, fenced, orders, pis)
	if slowStatus != http.StatusConflict {
		t.Errorf("slow attempt: %d, want 409 (its commit refused)", slowStatus)
	}
	if orders != 1 || pis != 1 {
		t.Errorf("orders %d, payments %d; want 1 each", orders, pis)
	}
	c.audit(t)
}
