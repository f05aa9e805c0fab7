package ordersapp

// The fault suite between the service and its dependencies (issue 10,
// point 2): a fault proxy (cmd/internal/faultproxy, toxiproxy as a library in
// this process, on 127.0.0.1) between `orders serve` processes and
// PostgreSQL, the gateway and Redis. Each case runs a load of duplicated
// keys through the retrying client and ends with the same checks
// (faultCheck): every copy of a key got 201 with the same order and
// payment, one order per key, one succeeded payment per order, no payment
// without its order, and `orders audit` clean with nothing pending.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/cmd/internal/faultproxy"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
)

// faultNewChain starts a standalone gateway for a chain on database db,
// without order services: faultAddInstance adds them, each with its own
// way to the database and to the gateway.
func faultNewChain(t *testing.T, db string, payArgs ...string) *chain {
	t.Helper()
	_, paymentsBin := binaries(t)
	c := &chain{db: db, dir: t.TempDir(), natsURL: testNATS(t)}
	payAddr := freeAddr(t)
	c.payURL = "http://" + payAddr
	c.payments = start(t, c.payURL+"/v1/payment_intents", paymentsBin, append([]string{"serve", "--addr", payAddr}, payArgs...)...)
	return c
}

// faultAddInstance starts one `orders serve` of chain c on dbURL, paying
// through payURL, and returns its base URL.
func faultAddInstance(t *testing.T, c *chain, dbURL, payURL string, args ...string) string {
	t.Helper()
	ordersBin, _ := binaries(t)
	addr := freeAddr(t)
	all := append([]string{"serve", "--addr", addr, "--data-dir", c.dir, "--database-url", dbURL,
		"--jwt-secret", testSecret, "--payments-url", payURL, "--nats-url", c.natsURL}, args...)
	c.orders = append(c.orders, start(t, "http://"+addr+"/healthz", ordersBin, all...))
	c.bases = append(c.bases, "http://"+addr)
	return "http://" + addr
}

// faultHostPort returns the host:port of a postgres:// or redis:// URL,
// or of a chain's gateway URL.
func faultHostPort(t *testing.T, u string) string {
	t.Helper()
	if strings.HasPrefix(u, "postgres") {
		cfg, err := pgx.ParseConfig(u)
		if err != nil {
			t.Fatal(err)
		}
		return net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))
	}
	rest := u[strings.Index(u, "://")+3:]
	if i := strings.IndexAny(rest, "/?"); i >= 0 {
		rest = rest[:i]
	}
	if i := strings.LastIndex(rest, "@"); i >= 0 {
		rest = rest[i+1:]
	}
	return rest
}

// faultAnswer is the final answer one client got for one copy of a key.
type faultAnswer struct {
	status    int
	orderID   string
	paymentID string
	replayed  bool
	err       error
}

// faultStorm is a load of keys, each sent by copies clients at once
// through the retrying client, spread over the instances.
type faultStorm struct {
	prefix               string
	keys, copies, users  int
	answers              [][]faultAnswer // [key][copy]
	answered             atomic.Int64    // final answers so far
	sent                 atomic.Int64    // attempts that reached the network
	mu                   sync.Mutex      // guards statuses
	statuses             map[int]int     // status of every attempt (0: failed in transit)
	retry409, retry5xx   atomic.Int64
	retryTransit, others atomic.Int64
	took                 time.Duration
}

func faultNewStorm(prefix string, keys, copies, users int) *faultStorm {
	s := &faultStorm{prefix: prefix, keys: keys, copies: copies, users: users, statuses: map[int]int{}}
	s.answers = make([][]faultAnswer, keys)
	for k := range s.answers {
		s.answers[k] = make([]faultAnswer, copies)
	}
	return s
}

func (s *faultStorm) key(k int) string  { return fmt.Sprintf("%s-%d", s.prefix, k) }
func (s *faultStorm) user(k int) string { return fmt.Sprintf("%s-user-%d", s.prefix, k%s.users) }

// RoundTrip counts each attempt and its status.
func (s *faultStorm) RoundTrip(r *http.Request) (*http.Response, error) {
	s.sent.Add(1)
	resp, err := http.DefaultTransport.RoundTrip(r)
	s.mu.Lock()
	if err != nil {
		s.statuses[0]++
	} else {
		s.statuses[resp.StatusCode]++
	}
	s.mu.Unlock()
	return resp, err
}

// client is the retrying client of the package client, bounded by a
// minute of retrying, its attempts counted.
func (s *faultStorm) client() *http.Client {
	return &http.Client{Transport: &client.Transport{
		Base:           s,
		MaxAttempts:    1000, // the deadline bounds the retries
		InitialBackoff: 20 * time.Millisecond,
		MaxBackoff:     500 * time.Millisecond,
		MaxElapsed:     time.Minute,
		OnRetry: func(_ int, resp *http.Response, err error, _ time.Duration) {
			switch {
			case err != nil:
				s.retryTransit.Add(1)
			case resp.StatusCode == http.StatusConflict:
				s.retry409.Add(1)
			case resp.StatusCode >= 500:
				s.retry5xx.Add(1)
			default:
				s.others.Add(1)
			}
		},
	}}
}

// faultSend posts order k with key and user through hc and reads the
// final answer.
func faultSend(hc *http.Client, base, user, key string, k int) faultAnswer {
	req, err := http.NewRequest(http.MethodPost, base+"/v1/orders", strings.NewReader(orderBody(k)))
	if err != nil {
		return faultAnswer{err: err}
	}
	tok, _ := issue(user)
	req.Header.Set("Authorization", "Bearer "+tok)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := hc.Do(req)
	if err != nil {
		return faultAnswer{err: err}
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	a := faultAnswer{status: resp.StatusCode, replayed: resp.Header.Get("Idempotent-Replayed") == "true"}
	var o struct {
		ID        string `json:"id"`
		PaymentID string `json:"payment_id"`
		Type      string `json:"type"`
	}
	_ = json.Unmarshal(body, &o) // not JSON: no ids, no type; the status tells
	a.orderID, a.paymentID = o.ID, o.PaymentID
	if resp.StatusCode >= 300 {
		a.orderID = o.Type // the problem's type, for the failure message
	}
	return a
}

// run sends the storm: parallel keys at a time, every copy of a key at
// once, copy cp of key k to bases[(k+cp) % len(bases)].
func (s *faultStorm) run(bases []string, parallel int) {
	t0 := time.Now()
	hc := s.client()
	sem := make(chan struct{}, parallel)
	var wg sync.WaitGroup
	for k := 0; k < s.keys; k++ {
		sem <- struct{}{}
		var kw sync.WaitGroup
		for cp := 0; cp < s.copies; cp++ {
			wg.Add(1)
			kw.Add(1)
			go func(k, cp int) {
				defer wg.Done()
				defer kw.Done()
				s.answers[k][cp] = faultSend(hc, bases[(k+cp)%len(bases)], s.user(k), s.key(k), k)
				s.answered.Add(1)
			}(k, cp)
		}
		go func() { kw.Wait(); <-sem }()
	}
	wg.Wait()
	s.took = time.Since(t0)
}

// waitAnswered waits until n final answers came, or the storm ended
// (done closed); it reports whether the storm was still running.
func (s *faultStorm) waitAnswered(n int64, done <-chan struct{}) bool {
	for s.answered.Load() < n {
		select {
		case <-done:
			return false
		case <-time.After(2 * time.Millisecond):
		}
	}
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// statusLine lists the statuses of every attempt, "201:600 409:12 0:3".
func (s *faultStorm) statusLine() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var codes []int
	for c := range s.statuses {
		codes = append(codes, c)
	}
	sort.Ints(codes)
	var parts []string
	for _, c := range codes {
		parts = append(parts, fmt.Sprintf("%d:%d", c, s.statuses[c]))
	}
	return strings.Join(parts, " ")
}

// faultResult is what faultCheck counted.
type faultResult struct {
	orders, payments, orphans, paidTwice, dupOrders int
	audit                                           string
}

// faultCheck checks what a storm left: every copy of every key answered
// 201 with the same order and payment (the retrying clients all got one
// answer); one order per key and no other order; one succeeded payment
// per order and none without its order; the orders' payments are those;
// `orders audit` clean with nothing pending.
func faultCheck(t *testing.T, c *chain, s *faultStorm) faultResult {
	t.Helper()
	created, replays := 0, 0
	var bad []string
	want := map[string]string{} // "user/key" → order id every copy got
	for k := 0; k < s.keys; k++ {
		first := s.answers[k][0]
		for cp, a := range s.answers[k] {
			switch {
			case a.err != nil:
				bad = append(bad, fmt.Sprintf("%s copy %d: no answer: %v", s.key(k), cp, a.err))
			case a.status != http.StatusCreated:
				bad = append(bad, fmt.Sprintf("%s copy %d: %d %s", s.key(k), cp, a.status, a.orderID))
			case a.orderID != first.orderID || a.paymentID != first.paymentID:
				bad = append(bad, fmt.Sprintf("%s copy %d: order %s payment %s, copy 0 got %s %s", s.key(k), cp, a.orderID, a.paymentID, first.orderID, first.paymentID))
			default:
				created++
				if a.replayed {
					replays++
				}
			}
		}
		want[s.user(k)+"/"+s.key(k)] = first.orderID
	}
	t.Logf("load: %d keys x %d copies, %d users, %v; %d attempts sent, statuses of every attempt %s; retries: %d after 409, %d after 5xx, %d after a failure in transit, %d other; final answers: %d of %d are 201 (%d replays)",
		s.keys, s.copies, s.users, s.took.Round(time.Millisecond), s.sent.Load(), s.statusLine(),
		s.retry409.Load(), s.retry5xx.Load(), s.retryTransit.Load(), s.others.Load(), created, s.keys*s.copies, replays)
	if len(bad) > 0 {
		t.Errorf("%d of %d copies did not all get the same 201: %s", len(bad), s.keys*s.copies, strings.Join(bad[:min(len(bad), 20)], "; "))
	}

	// The orders.
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, c.db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT id, user_id, coalesce(idempotency_key, ''), payment_id FROM orders`)
	if err != nil {
		t.Fatal(err)
	}
	type order struct{ id, user, key, payment string }
	orders, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (order, error) {
		var o order
		err := r.Scan(&o.id, &o.user, &o.key, &o.payment)
		return o, err
	})
	if err != nil {
		t.Fatal(err)
	}
	var res faultResult
	res.orders = len(orders)
	perKey := map[string]int{}
	orderIDs := map[string]string{} // order id → payment id
	for _, o := range orders {
		perKey[o.user+"/"+o.key]++
		orderIDs[o.id] = o.payment
		if w, ok := want[o.user+"/"+o.key]; !ok {
			t.Errorf("order %s for %s/%s, a key the load did not send", o.id, o.user, o.key)
		} else if len(bad) == 0 && w != o.id {
			t.Errorf("order %s for %s/%s; the clients got %s", o.id, o.user, o.key, w)
		}
	}
	for k, n := range perKey {
		if n > 1 {
			res.dupOrders++
			t.Errorf("DUPLICATE: %d orders for key %s", n, k)
		}
	}
	if res.orders != s.keys {
		t.Errorf("%d orders for %d keys", res.orders, s.keys)
	}

	// The payments.
	cl := payments.NewClient(payments.ClientConfig{BaseURL: c.payURL, APIKey: "sk_test_local", HTTPClient: &http.Client{}})
	perOrder := map[string][]string{}
	for ch, err := range cl.All(ctx) {
		if err != nil {
			t.Fatal(err)
		}
		if ch.Status != "succeeded" {
			continue
		}
		res.payments++
		ref := ch.Metadata["order_ref"]
		perOrder[ref] = append(perOrder[ref], ch.ID)
		if _, ok := orderIDs[ref]; !ok {
			res.orphans++
			t.Errorf("PAYMENT WITHOUT ORDER: %s for order %s", ch.ID, ref)
		}
	}
	for ref, ids := range perOrder {
		if len(ids) > 1 {
			res.paidTwice++
			t.Errorf("PAID TWICE: order %s has succeeded payments %v", ref, ids)
		}
	}
	for id, pay := range orderIDs {
		if ids := perOrder[id]; len(ids) != 1 || ids[0] != pay {
			t.Errorf("order %s records payment %s; its succeeded payments: %v", id, pay, ids)
		}
	}
	res.audit = c.audit(t)
	t.Logf("orders %d (keys with more than one: %d), succeeded payments %d (orders paid more than once: %d, payments without an order: %d); audit: %s",
		res.orders, res.dupOrders, res.payments, res.paidTwice, res.orphans, faultAuditLine(res.audit))
	return res
}

// faultAuditLine condenses the audit's report to its verdict and counts.
func faultAuditLine(out string) string {
	var keep []string
	for _, l := range strings.Split(out, "\n") {
		l = strings.Join(strings.Fields(l), " ")
		if strings.HasPrefix(l, "OK") || strings.HasPrefix(l, "pending") || strings.HasPrefix(l, "FAIL") {
			keep = append(keep, l)
		}
	}
	return strings.Join(keep, "; ")
}

// faultMetric reads one counter of an instance's /metrics (0 if absent).
func faultMetric(t *testing.T, base, name string) int64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Logf("metrics of %s: %v", base, err)
		return 0
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			n, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return int64(n)
		}
	}
	return 0
}

// faultSum adds one counter over the instances.
func faultSum(t *testing.T, bases []string, name string) int64 {
	var n int64
	for _, b := range bases {
		n += faultMetric(t, b, name)
	}
	return n
}

// faultCompletionMarker is in the text of pgstore's completion (the
// fenced UPDATE that stores the answer, sent with its COMMIT as one
// simple-protocol query whose parameters pgx writes into the text), and
// in no other statement.
const faultCompletionMarker = "SET response_status = "

// faultCompletionKey reads the user and key from the text of pgstore's
// completion ("WHERE user_id = '…' AND key = '…'", as pgx quotes them,
// with a space on either side).
var faultCompletionKey = regexp.MustCompile(`WHERE user_id = \s*'((?:[^']|'')*)'\s* AND key = \s*'((?:[^']|'')*)'`)

// faultCommitCut is the commit cut on pgstore's completion, naming each
// cut by its (user, key).
func faultCommitCut() []faultproxy.Option {
	return []faultproxy.Option{
		faultproxy.WithCommitCut(faultCompletionMarker, 0, 1),
		faultproxy.WithQueryParams(func(sql string) []string {
			m := faultCompletionKey.FindStringSubmatch(sql)
			if m == nil {
				return nil
			}
			return []string{strings.ReplaceAll(m[1], "''", "'"), strings.ReplaceAll(m[2], "''", "'")}
		}),
	}
}

// Case 1. The connection to PostgreSQL is cut after the server executed
// the COMMIT of a completion (the transaction that writes the order and
// stores its answer) and before its answer reaches the service, for 30%
// of completions: the service cannot know that it committed. Two
// instances, 150 keys x 4 copies. Besides faultCheck: cuts happened at
// that point (the dropped answer was CommandComplete "COMMIT"), and every
// key whose completion was cut has its answer stored, with exactly one
// order; a message id of the receipts consumer whose completion was cut
// has its outcome stored, with exactly one receipt.
func TestFaultCommitCut(t *testing.T) {
	db := pgtest.Database(t)
	pg := faultproxy.New(t, "pg", faultHostPort(t, db), faultCommitCut()...)
	c := faultNewChain(t, db)
	for i := 0; i < 2; i++ {
		faultAddInstance(t, c, pg.PostgresURL(db), c.payURL, "--key-lease", "3s")
	}
	s := faultNewStorm("cut", 150, 4, 5)
	pg.SetCutFraction(0.3)
	s.run(c.bases, 40)
	pg.SetCutFraction(0)

	st := pg.CommitStats()
	cuts := pg.Cuts()
	t.Logf("commit cuts: %+v", st)
	res := faultCheck(t, c, s)
	if st.PairingErrors != 0 || st.Opaque != 0 {
		t.Errorf("the proxy misread the protocol: %+v", st)
	}
	if st.CutCommitted == 0 {
		t.Fatalf("no connection was cut after an executed COMMIT: %+v", st)
	}
	// Each cut after an executed COMMIT names its (user, key): the answer
	// is stored, though the service lost the connection before knowing.
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	committed, other := 0, map[string]int{}
	for _, cut := range cuts {
		if cut.Outcome != "COMMIT" {
			other[cut.Outcome]++
			continue
		}
		committed++
		if len(cut.Params) != 2 {
			t.Errorf("cut without its user and key: %+v", cut)
			continue
		}
		var status *int
		var orders int
		if cut.Params[0] == receiptsUser {
			// The consumer's idem.Do: a 200 outcome and one receipt.
			err := conn.QueryRow(ctx, `SELECT response_status, (SELECT count(*) FROM receipts WHERE event_id = $2)
				FROM idempotency_keys WHERE user_id = $1 AND key = $2`, cut.Params[0], cut.Params[1]).Scan(&status, &orders)
			if err != nil || status == nil || *status != http.StatusOK || orders != 1 {
				t.Errorf("message id %s, whose completion's COMMIT was executed then cut: stored status %v, %d receipts (%v); want 200 and 1", cut.Params[1], status, orders, err)
			}
			continue
		}
		err := conn.QueryRow(ctx, `SELECT response_status, (SELECT count(*) FROM orders WHERE user_id = $1 AND idempotency_key = $2)
			FROM idempotency_keys WHERE user_id = $1 AND key = $2`, cut.Params[0], cut.Params[1]).Scan(&status, &orders)
		if err != nil {
			t.Errorf("key %s/%s of a cut: %v", cut.Params[0], cut.Params[1], err)
			continue
		}
		if status == nil || *status != http.StatusCreated || orders != 1 {
			t.Errorf("key %s/%s, whose completion's COMMIT was executed then cut: stored status %v, %d orders; want 201 and 1", cut.Params[0], cut.Params[1], status, orders)
		}
	}
	t.Logf("case 1 (commit cut): %d cuts after an executed COMMIT, each key's answer found stored with one order; other cuts %v; store errors seen by the service %d, 5xx answers %d; %d orders, %d payments",
		committed, other, faultSum(t, c.bases, "idem_store_errors_total"), s.retry5xx.Load(), res.orders, res.payments)
}

// Case 2. Latency on every dependency during a load with duplicates: two
// instances, both with PostgreSQL (10ms ± 10ms each way) and the gateway
// (100ms ± 100ms on its answers) behind proxies, and each with Redis
// behind a proxy of its own: instance 0's Redis answers in 5ms ± 5ms, so
// that Redis serves it; instance 1's in 40ms ± 40ms, around the service's
// 50ms deadline for a Redis call, so that many of its calls time out and
// the database decides alone. 150 keys x 4 copies, each key's copies on
// both instances.
func TestFaultLatency(t *testing.T) {
	db := pgtest.Database(t)
	rURL := redisURL(t)
	c := faultNewChain(t, db)
	pg := faultproxy.New(t, "pg", faultHostPort(t, db))
	gw := faultproxy.New(t, "gateway", faultHostPort(t, c.payURL))
	rdFast := faultproxy.New(t, "redis-fast", faultHostPort(t, rURL))
	rdSlow := faultproxy.New(t, "redis-slow", faultHostPort(t, rURL))
	for _, rd := range []*faultproxy.Proxy{rdFast, rdSlow} {
		faultAddInstance(t, c, pg.PostgresURL(db), gw.URL(c.payURL), "--key-lease", "5s", "--key-ttl", "1h", "--redis-url", rd.URL(rURL))
	}
	for _, l := range []struct {
		p       *faultproxy.Proxy
		dir     faultproxy.Direction
		latency time.Duration
	}{
		{pg, faultproxy.Upstream, 10 * time.Millisecond},
		{pg, faultproxy.Downstream, 10 * time.Millisecond},
		{gw, faultproxy.Downstream, 100 * time.Millisecond},
		{rdFast, faultproxy.Downstream, 5 * time.Millisecond},
		{rdSlow, faultproxy.Downstream, 40 * time.Millisecond},
	} {
		remove, err := l.p.Latency(l.dir, l.latency, l.latency)
		if err != nil {
			t.Fatal(err)
		}
		defer remove()
	}
	s := faultNewStorm("slow", 150, 4, 5)
	s.run(c.bases, 40)
	res := faultCheck(t, c, s)
	for i, base := range c.bases {
		t.Logf("case 2 (latency), instance %d: Redis errors (50ms deadline passed) %d, replays from Redis %d, 409 from a Redis lock %d, answers cached %d",
			i, faultMetric(t, base, "idem_redis_errors_total"), faultMetric(t, base, "idem_redis_replays_total"),
			faultMetric(t, base, "idem_redis_in_flight_total"), faultMetric(t, base, "idem_redis_cache_fills_total"))
	}
	t.Logf("case 2 (latency): %d orders, %d payments", res.orders, res.payments)
	if n := faultMetric(t, c.bases[1], "idem_redis_errors_total"); n == 0 {
		t.Errorf("no Redis call of instance 1 timed out: its Redis latency did not reach it")
	}
}
