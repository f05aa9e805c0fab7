package ordersapp

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/cmd/internal/faultproxy"
	"github.com/idem-go/idem/internal/pgtest"
)

// faultFirst is a RoundTripper that keeps the status and problem type of
// the first attempt it carries.
type faultFirst struct {
	base   http.RoundTripper
	mu     sync.Mutex
	done   bool
	status int
	typ    string
}

func (f *faultFirst) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := f.base.RoundTrip(r)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.done {
		return resp, err
	}
	f.done = true
	if err != nil {
		f.typ = "no answer: " + err.Error()
		return resp, err
	}
	f.status = resp.StatusCode
	if resp.StatusCode >= 300 {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(b))
		var p struct {
			Type string `json:"type"`
		}
		_ = json.Unmarshal(b, &p) // not a problem document: no type
		f.typ = p.Type[strings.LastIndex(p.Type, "/")+1:]
	}
	return resp, err
}

func (f *faultFirst) label() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.status == 0 {
		return f.typ
	}
	if f.typ == "" {
		return fmt.Sprint(f.status)
	}
	return fmt.Sprintf("%d %s", f.status, f.typ)
}

// Case 3. A partition while keys are in flight. Two instances, A and B,
// lease 3s, the gateway charging after 3s. 20 keys are sent to A, each
// by a retrying client; once every key is claimed (its row in the
// database, no order yet: A's handlers are waiting for the gateway), A's
// path to PostgreSQL (subtest postgres) or to the gateway (subtest
// gateway) is partitioned: the traffic held both ways, the connections
// open, as while a link is down. Then:
//   - B answers 409 with Retry-After for every key while its lease is
//     live (one plain request per key, checked against the lease left
//     by the database's clock);
//   - a retrying client per key on B gets 201 once the lease ran out
//     (B takes the key over, or its completer re-drives it), while A's
//     clients still wait;
//   - the partition heals: A's held attempts go on and must not complete
//     (their first answer is not 201: the order exists, or the lease is
//     fenced), and A's clients, retrying, get B's answer.
//
// In subtests postgres and gateway the partition heals once B answered
// every key: A's attempts then find B's order written (409
// order-conflict). In subtest postgres-heal-after-takeover (B's path to
// the gateway 2s slower) it heals as soon as B took every key over,
// while B waits for the gateway: A's attempts write their order and reach
// their completion, which the fence refuses (idem_fenced_total).
//
// Then faultCheck: one order and one payment per key, audit clean.
func TestFaultPartition(t *testing.T) {
	t.Run("postgres", func(t *testing.T) { faultPartition(t, "postgres", false) })
	t.Run("gateway", func(t *testing.T) { faultPartition(t, "gateway", false) })
	t.Run("postgres-heal-after-takeover", func(t *testing.T) { faultPartition(t, "postgres", true) })
}

func faultPartition(t *testing.T, path string, healAfterTakeover bool) {
	db := pgtest.Database(t)
	// The gateway charges 3s after each request: long enough for A's 20
	// claims to be written, even on a loaded machine, before any of A's
	// handlers goes on to write its order.
	c := faultNewChain(t, db, "--latency", "3s")
	pgA := faultproxy.New(t, "pg-a", faultHostPort(t, db))
	gwA := faultproxy.New(t, "gateway-a", faultHostPort(t, c.payURL))
	gwB := faultproxy.New(t, "gateway-b", faultHostPort(t, c.payURL))
	if healAfterTakeover {
		// B's lookups and payments answered 2s late: the window between
		// B's takeover and B's order.
		remove, err := gwB.Latency(faultproxy.Downstream, 2*time.Second, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer remove()
	}
	a := faultAddInstance(t, c, pgA.PostgresURL(db), gwA.URL(c.payURL), "--key-lease", "3s")
	b := faultAddInstance(t, c, db, gwB.URL(c.payURL), "--key-lease", "3s")
	cut := pgA
	if path == "gateway" {
		cut = gwA
	}

	const n = 20
	s := faultNewStorm("part-"+path, n, 2, 1) // copy 0: A's client; copy 1: B's
	user := s.user(0)
	firsts := make([]*faultFirst, n)
	aDone := make(chan int, n)
	t0 := time.Now()
	for k := 0; k < n; k++ {
		firsts[k] = &faultFirst{base: s}
		hc := &http.Client{Transport: &client.Transport{
			Base: firsts[k], MaxAttempts: 1000, InitialBackoff: 20 * time.Millisecond, MaxBackoff: 500 * time.Millisecond, MaxElapsed: time.Minute,
		}}
		go func(k int) {
			s.answers[k][0] = faultSend(hc, a, user, s.key(k), k)
			aDone <- k
		}(k)
	}

	// Every key claimed by A, none paid for and written.
	claimed := 0
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) { // a poll with a deadline
		if claimed = countRows(t, db, fmt.Sprintf(`SELECT count(*) FROM idempotency_keys WHERE user_id = '%s'`, user)); claimed == n {
			break
		}
	}
	if claimed != n {
		t.Fatalf("%d of %d keys claimed by A after 20s", claimed, n)
	}
	cut.Partition()
	partitioned := time.Since(t0)
	if got := countRows(t, db, `SELECT count(*) FROM orders`); got != 0 {
		t.Fatalf("%d orders written before the partition: it came too late", got)
	}

	// B, while the leases are live: 409 with Retry-After.
	var leaseLeft float64
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if err := conn.QueryRow(ctx, `SELECT coalesce(min(extract(epoch FROM lease_until - clock_timestamp())), 0)::float8
		FROM idempotency_keys WHERE user_id = $1 AND response_status IS NULL`, user).Scan(&leaseLeft); err != nil {
		t.Fatal(err)
	}
	probeStart := time.Now()
	probes := map[string]int{}
	for k := 0; k < n; k++ {
		req, _ := http.NewRequest(http.MethodPost, b+"/v1/orders", strings.NewReader(orderBody(k)))
		req.Header.Set("Authorization", "Bearer "+token(t, user))
		req.Header.Set("Idempotency-Key", s.key(k))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			probes["no answer"]++
			continue
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		l := fmt.Sprint(resp.StatusCode)
		if ra := resp.Header.Get("Retry-After"); ra != "" {
			l += " Retry-After: " + ra
		}
		probes[l]++
	}
	probesTook := time.Since(probeStart)
	inLease := probesTook.Seconds() < leaseLeft
	t.Logf("partition of A's path to the %s %v after the first request (every key claimed, no order); B's answers during the lease (%.2fs left, probes took %v): %v",
		path, partitioned.Round(time.Millisecond), leaseLeft, probesTook.Round(time.Millisecond), probes)
	if probes["409 Retry-After: 1"] == 0 || (inLease && probes["409 Retry-After: 1"] != n) {
		t.Errorf("B's answers while the leases were live: %v; want %d x 409 with Retry-After", probes, n)
	}

	// B, retrying: each key ends after its lease, while A is cut off.
	var wg sync.WaitGroup
	hcB := s.client()
	for k := 0; k < n; k++ {
		wg.Add(1)
		go func(k int) {
			defer wg.Done()
			s.answers[k][1] = faultSend(hcB, b, user, s.key(k), k)
		}(k)
	}
	var bDone time.Duration
	var waiting, ordersBeforeHeal int
	if healAfterTakeover {
		// Heal once B holds every key (a second attempt), before it wrote
		// any order.
		takenOver := 0
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) { // a poll with a deadline
			if takenOver = countRows(t, db, fmt.Sprintf(`SELECT count(*) FROM idempotency_keys WHERE user_id = '%s' AND attempts >= 2`, user)); takenOver == n {
				break
			}
		}
		if takenOver != n {
			t.Fatalf("%d of %d keys taken over by B after 30s", takenOver, n)
		}
		bDone = time.Since(t0)
		waiting = n - len(aDone)
		ordersBeforeHeal = countRows(t, db, `SELECT count(*) FROM orders`)
	}
	if !healAfterTakeover {
		wg.Wait()
		bDone = time.Since(t0)
		waiting = n - len(aDone)
		ordersBeforeHeal = countRows(t, db, `SELECT count(*) FROM orders`)
	}
	held := cut.Held()

	cut.Heal()
	wg.Wait()
	for i := 0; i < n; i++ {
		<-aDone
	}
	s.took = time.Since(t0)
	aFirst := map[string]int{}
	for k, f := range firsts {
		aFirst[f.label()]++
		if f.status == http.StatusCreated {
			t.Errorf("key %s: A's held attempt answered 201 after the heal: it completed a key that B had completed", s.key(k))
		}
	}
	var labels []string
	for l, m := range aFirst {
		labels = append(labels, fmt.Sprintf("%d x %s", m, l))
	}
	sort.Strings(labels)
	fenced := faultMetric(t, a, "idem_fenced_total")
	what := "B's retrying clients done"
	if healAfterTakeover {
		what = "every key taken over by B"
	}
	t.Logf("%s %v after the first request, orders then %d, A's clients still waiting %d, chunks held by the partition %d; after the heal, A's first answers: %s; A fenced at completion %d",
		what, bDone.Round(time.Millisecond), ordersBeforeHeal, waiting, held, strings.Join(labels, ", "), fenced)
	if waiting == 0 {
		t.Errorf("every client of A had its answer before the heal: the partition did not hold A's attempts")
	}
	switch {
	case !healAfterTakeover && ordersBeforeHeal != n:
		t.Errorf("%d orders before the heal, want %d (B's)", ordersBeforeHeal, n)
	case healAfterTakeover && ordersBeforeHeal == 0 && fenced == 0:
		t.Errorf("healed before B wrote any order, yet no attempt of A was fenced at its completion: first answers %s", strings.Join(labels, ", "))
	}
	res := faultCheck(t, c, s)
	variant := path
	if healAfterTakeover {
		variant += ", healed after B's takeovers"
	}
	t.Logf("case 3 (partition, %s): %d keys, %d orders, %d payments", variant, n, res.orders, res.payments)
}
