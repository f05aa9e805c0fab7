package ordersapp

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/cmd/internal/pgha"
	"github.com/idem-go/idem/internal/pgtest"
)

// TestFailoverPostgres (issue 10, point 3): two `orders serve` processes
// on a pg_auto_failover formation on loopback (see cmd/internal/pgha): a
// primary and two standbys, number_sync_standbys = 1, so that a commit
// waits for a standby to have it on disk and the primary never falls back
// to asynchronous replication (with a single standby, pg_auto_failover
// 2.0's perform failover can, and then loses committed transactions: see
// pgha.Formation.Failover); the formation is the one the test shares with
// TestFailoverPostgresSQLASCII (failoverFormation). The services use its
// multi-host URL (target_session_attrs=read-write) on a UTF8 database of
// the test's own; the gateway is a standalone `payments serve` whose
// ledger is on the shared PostgreSQL, outside the formation, as a real
// provider's would be: a charge survives whatever happens to the order
// service's database. Two storms of 300 keys, 3 copies each, through the
// retrying client; a third of the way into each, (a) `pg_autoctl perform
// failover`, then, once the old primary is back as a synchronous standby,
// (b) the primary killed (SIGKILL to its pg_autoctl, postgres and
// backends) so that the monitor promotes a standby. After each: every
// request ended 201, the requests sent after the switch too; every 201
// answer a client saw (before, during and after the switch) has its order
// and that same stored answer on the new primary, and every key sent again
// after the switch is a replay of it; no key with two orders, one
// succeeded payment per order and none without its order; `orders audit`
// clean.
func TestFailoverPostgres(t *testing.T) {
	f := failoverFormation(t)
	db := f.Database(t, "")
	payDB := pgtest.Database(t)
	c := failoverChain(t, db, payDB)

	t.Run("perform failover", func(t *testing.T) {
		s := f.RequireSynchronous(t, time.Minute)
		t.Logf("before: %s", s)
		failoverPhase(t, c, "fa", func(t *testing.T) string { return failoverPerform(t, f) })
	})
	if t.Failed() {
		return
	}
	t.Run("kill primary", func(t *testing.T) {
		s := f.RequireHealthy(t, 2*time.Minute) // the old primary back as a standby, one synchronous
		t.Logf("before: %s", s)
		failoverPhase(t, c, "fb", func(t *testing.T) string {
			old, err := f.Primary(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			killed := time.Now()
			f.Kill(old)
			p, took := f.WaitNewPrimary(t, old, killed, 2*time.Minute)
			return fmt.Sprintf("%s killed (SIGKILL to pg_autoctl, its postgres and backends); %s took writes %v later",
				old.Name, p.Name, took.Round(time.Millisecond))
		})
	})
}

// The same storm and switchover on a database whose encoding is
// SQL_ASCII: the service's pool sets client_encoding itself, so its
// completions never depend on the database's encoding. Before, every
// completion failed there (pgx refuses its simple protocol on a SQL_ASCII
// session) and no order was made.
//
// The database is one of the test's own on the formation it shares with
// TestFailoverPostgres, created SQL_ASCII under the C locale (as initdb or
// pg_autoctl under the C locale make every database): the encoding is the
// database's, not the server's, so every session on it has
// server_encoding SQL_ASCII and, unless it sets its own, client_encoding
// SQL_ASCII, what the service meets on a formation built under the C
// locale; physical replication carries the database as it is to the
// standbys, and the test checks it on the primary before the switch and
// on the new primary after it.
func TestFailoverPostgresSQLASCII(t *testing.T) {
	f := failoverFormation(t)
	db := f.Database(t, pgtest.SQLASCII)
	encoding := func() string {
		t.Helper()
		var enc string
		if err := pgx.BeginFunc(context.Background(), mustConnect(t, db), func(tx pgx.Tx) error {
			return tx.QueryRow(context.Background(), `SELECT pg_encoding_to_char(encoding) FROM pg_database WHERE datname = current_database()`).Scan(&enc)
		}); err != nil {
			t.Fatal(err)
		}
		return enc
	}
	if enc := encoding(); enc != "SQL_ASCII" {
		t.Fatalf("the test's database is %s, want SQL_ASCII", enc)
	}
	payDB := pgtest.Database(t)
	t.Logf("SQL_ASCII database on the formation: %s", db)
	c := failoverChain(t, db, payDB)
	s := f.RequireSynchronous(t, time.Minute)
	t.Logf("before: %s", s)
	failoverPhase(t, c, "fs", func(t *testing.T) string { return failoverPerform(t, f) })
	if enc := encoding(); enc != "SQL_ASCII" {
		t.Errorf("the test's database on the new primary is %s, want SQL_ASCII", enc)
	}
}

// The pg_auto_failover formation that TestFailoverPostgres and
// TestFailoverPostgresSQLASCII share: both need the same one, a primary
// and two standbys, and building one takes 15 to 20 s on the CI machine's
// two cores, tearing it down a few more. Each test keeps its rows in a
// database of its own (pgha's Formation.Database) and finds the formation
// as the other left it, its primary switched over or killed:
// failoverFormation makes it whole again first.
var failoverShared struct {
	mu   sync.Mutex
	f    *pgha.Formation
	err  error // Launch's: every test after it fails with it
	done int   // tests on f that have ended
}

// failoverFormationUsers is how many tests share the formation. It is
// stopped once that many have ended on it, rather than after m.Run, so
// that it does not take CPU from the package's tests that run after them;
// TestMain stops it when fewer ran (-run), and after a stop the next test
// (-count) builds a new one.
const failoverFormationUsers = 2

// failoverFormation returns the shared formation, built by the first
// test that asks (it skips t unless pgha's tests are to run, and under
// -short), once every node is in place and a standby synchronous
// (RequireHealthy, within two minutes: a formation that the test before
// left broken fails t rather than hang it). If the formation did not
// start, every test that asks fails with that error. On t's failure, the
// monitor's last events and each node's last log lines are logged.
func failoverFormation(t *testing.T) *pgha.Formation {
	t.Helper()
	pgha.SkipUnlessEnabled(t)
	skipInShort(t, "runs a pg_auto_failover formation and the orders and payments binaries")
	s := &failoverShared
	s.mu.Lock()
	if s.f == nil && s.err == nil {
		s.f, s.err = pgha.Launch(2)
		s.done = 0
		if s.err == nil {
			t.Logf("pg_auto_failover formation for the failover tests %s", s.f.Setup)
		}
	}
	f, err := s.f, s.err
	s.mu.Unlock()
	if err != nil {
		t.Fatalf("the failover tests' pg_auto_failover formation did not start: %v", err)
	}
	t.Cleanup(func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.f != f {
			return
		}
		if s.done++; s.done == failoverFormationUsers {
			s.f = nil
			if err := f.Stop(); err != nil {
				t.Logf("pgha: %v", err)
			}
		}
	})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("monitor events:\n%s", f.Events(40))
			t.Log(f.NodeLogs(40))
		}
	})
	st := f.RequireHealthy(t, 2*time.Minute)
	t.Logf("formation: %s; %s", f.URL(), st)
	return f
}

// stopFailoverFormation stops the shared formation if fewer than
// failoverFormationUsers tests ran on it. TestMain calls it after m.Run.
func stopFailoverFormation() {
	s := &failoverShared
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.f != nil {
		if err := s.f.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "pgha: %v\n", err)
		}
		s.f = nil
	}
}

// mustConnect connects to url for the test.
func mustConnect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(ctx) })
	return conn
}

// failoverPerform runs `pg_autoctl perform failover` and describes it.
func failoverPerform(t *testing.T, f *pgha.Formation) string {
	p, writable, cmd := f.Failover(t)
	return fmt.Sprintf("pg_autoctl perform failover: %s took writes %v after the command began; the command returned after %v (the old primary back as a standby)",
		p.Name, writable.Round(time.Millisecond), cmd.Round(time.Millisecond))
}

// failoverChain starts the gateway (its ledger in payDB) and two order
// services on dbURL.
func failoverChain(t *testing.T, dbURL, payDB string) *chain {
	t.Helper()
	ordersBin, paymentsBin := binaries(t)
	c := &chain{db: dbURL, dir: t.TempDir(), natsURL: testNATS(t)}
	payAddr := freeAddr(t)
	c.payURL = "http://" + payAddr
	c.payments = start(t, c.payURL+"/v1/payment_intents", paymentsBin, "serve", "--addr", payAddr, "--database-url", payDB)
	for i := 0; i < 2; i++ {
		addr := freeAddr(t)
		c.orders = append(c.orders, start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", c.dir,
			"--database-url", dbURL, "--jwt-secret", testSecret, "--payments-url", c.payURL, "--key-lease", "3s", "--nats-url", c.natsURL))
		c.bases = append(c.bases, "http://"+addr)
	}
	return c
}

// failoverAnswer is the final answer one client got for one copy of a key.
type failoverAnswer struct {
	key, user      string
	status         int
	replayed       bool
	body           []byte
	err            error
	started, ended time.Time
}

const (
	failoverKeys     = 300
	failoverCopies   = 3
	failoverUsers    = 3
	failoverWorkers  = 24
	failoverRetryFor = 90 * time.Second
	// failoverFlowAgain bounds the time from the switch's end to the
	// first new order answered after it.
	failoverFlowAgain = 10 * time.Second
)

// failoverPhase runs one storm with prefix's keys, switches the primary
// with doSwitch (run on the test's goroutine; it returns a description)
// when a third of the requests have their answer, and checks everything
// after the storm.
func failoverPhase(t *testing.T, c *chain, prefix string, doSwitch func(*testing.T) string) {
	hc, counts := countingRetryClient(t, failoverWorkers, failoverRetryFor)
	tokens := map[string]string{}
	for u := 0; u < failoverUsers; u++ {
		user := fmt.Sprintf("failover-%s-user-%d", prefix, u)
		tokens[user] = token(t, user)
	}
	send := func(base string, k int) (a failoverAnswer) {
		a = failoverAnswer{key: fmt.Sprintf("%s-%d", prefix, k), user: fmt.Sprintf("failover-%s-user-%d", prefix, k%failoverUsers), started: time.Now()}
		defer func() { a.ended = time.Now() }()
		req, err := http.NewRequest(http.MethodPost, base+"/v1/orders", strings.NewReader(orderBody(k)))
		if err != nil {
			a.err = err
			return a
		}
		req.Header.Set("Authorization", "Bearer "+tokens[a.user])
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", a.key)
		resp, err := hc.Do(req)
		if err != nil {
			a.err = err
			return a
		}
		defer resp.Body.Close()
		a.body, a.err = io.ReadAll(resp.Body)
		a.status = resp.StatusCode
		a.replayed = resp.Header.Get("Idempotent-Replayed") == "true"
		return a
	}

	// The storm: the copies of one key are queued together, so that they
	// run at once on both instances.
	total := failoverKeys * failoverCopies
	jobs := make(chan [2]int, total)
	for k := 0; k < failoverKeys; k++ {
		for cp := 0; cp < failoverCopies; cp++ {
			jobs <- [2]int{k, cp}
		}
	}
	close(jobs)
	answers := make([]failoverAnswer, total)
	var finished atomic.Int64
	third := make(chan struct{})
	var wg sync.WaitGroup
	stormBegan := time.Now()
	for w := 0; w < failoverWorkers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				k, cp := j[0], j[1]
				answers[k*failoverCopies+cp] = send(c.bases[(k+cp)%len(c.bases)], k)
				if finished.Add(1) == int64(total/3) {
					close(third)
				}
			}
		}()
	}
	stormDone := make(chan struct{})
	go func() { wg.Wait(); close(stormDone) }()
	select {
	case <-third:
	case <-stormDone:
		t.Fatal("the storm ended before a third of its requests had an answer")
	}
	switchBegan := time.Now()
	how := doSwitch(t)
	switchEnded := time.Now()
	<-stormDone
	stormTook := time.Since(stormBegan)

	// After the switch: every key answered 201 is sent once more (a
	// replay, if its answer survived), and 30 new keys, each twice.
	var after []failoverAnswer
	var replayOf []failoverAnswer
	replayed := map[string]bool{}
	for _, a := range answers {
		if a.status == http.StatusCreated && !replayed[a.key] {
			replayed[a.key] = true
			replayOf = append(replayOf, a)
		}
	}
	var mu sync.Mutex
	var wg2 sync.WaitGroup
	sem := make(chan struct{}, failoverWorkers)
	for i, a := range replayOf {
		wg2.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg2.Done() }()
			var k int
			_, _ = fmt.Sscanf(strings.TrimPrefix(a.key, prefix+"-"), "%d", &k) // the test's own prefix-N keys
			r := send(c.bases[i%len(c.bases)], k)
			mu.Lock()
			after = append(after, r)
			mu.Unlock()
		}()
	}
	for k := failoverKeys; k < failoverKeys+30; k++ {
		for cp := 0; cp < 2; cp++ {
			wg2.Add(1)
			sem <- struct{}{}
			go func() {
				defer func() { <-sem; wg2.Done() }()
				r := send(c.bases[(k+cp)%len(c.bases)], k)
				mu.Lock()
				after = append(after, r)
				mu.Unlock()
			}()
		}
	}
	wg2.Wait()

	// What the clients saw.
	var preSwitch, during, postSwitch, inFlight, created, replays int
	bad := map[string]int{}
	seen := map[[2]string][]byte{} // (user, key) → the 201 body
	for _, a := range append(append([]failoverAnswer{}, answers...), after...) {
		if a.started.Before(switchBegan) && a.ended.After(switchBegan) {
			inFlight++
		}
		if a.started.After(switchEnded) {
			postSwitch++
		}
		if a.err != nil || a.status != http.StatusCreated {
			label := fmt.Sprint(a.status)
			if a.err != nil {
				label = "no answer: " + a.err.Error()
			}
			bad[label]++
			continue
		}
		created++
		if a.replayed {
			replays++
		}
		switch {
		case a.ended.Before(switchBegan):
			preSwitch++
		case a.ended.Before(switchEnded):
			during++
		}
		id := [2]string{a.user, a.key}
		if prev, ok := seen[id]; ok && !bytes.Equal(prev, a.body) {
			t.Errorf("key %s: two different 201 answers:\n%s\n%s", a.key, prev, a.body)
		}
		seen[id] = a.body
	}
	t.Logf("switch: %s", how)
	t.Logf("storm: %d keys x %d copies over 2 instances, %d workers, took %v; %v; %d requests in flight when the switch began, %d started after it ended",
		failoverKeys, failoverCopies, failoverWorkers, stormTook.Round(time.Millisecond), counts, inFlight, postSwitch)
	t.Logf("after the switch: every key answered 201 sent again (%d), 30 new keys x 2; final answers: %d of %d are 201 (%d replays; %d answered before the switch began, %d during it)",
		len(replayOf), created, len(answers)+len(after), replays, preSwitch, during)
	if len(bad) > 0 {
		t.Errorf("requests that did not end in 201 within %v of retrying: %v", failoverRetryFor, bad)
	}
	// Orders flow again within seconds of the switch: the first new
	// order answered after it ended (a replay needs only a read).
	var firstAfter time.Time
	for _, a := range append(append([]failoverAnswer{}, answers...), after...) {
		if a.err == nil && a.status == http.StatusCreated && !a.replayed && a.ended.After(switchEnded) &&
			(firstAfter.IsZero() || a.ended.Before(firstAfter)) {
			firstAfter = a.ended
		}
	}
	if firstAfter.IsZero() {
		t.Errorf("no new order answered 201 after the switch ended")
	} else {
		t.Logf("the first new order after the switch was answered %v after it ended", firstAfter.Sub(switchEnded).Round(time.Millisecond))
		if d := firstAfter.Sub(switchEnded); d > failoverFlowAgain {
			t.Errorf("the first new order after the switch came %v after it ended, want at most %v", d.Round(time.Millisecond), failoverFlowAgain)
		}
	}
	if inFlight == 0 || postSwitch == 0 || preSwitch == 0 {
		t.Errorf("the switch was not mid-storm: %d requests answered before it, %d in flight, %d started after it", preSwitch, inFlight, postSwitch)
	}
	for _, r := range after {
		if r.status == http.StatusCreated && strings.HasPrefix(r.key, prefix+"-") {
			var k int
			_, _ = fmt.Sscanf(strings.TrimPrefix(r.key, prefix+"-"), "%d", &k) // the test's own prefix-N keys
			if k < failoverKeys && !r.replayed {
				t.Errorf("key %s, answered 201 in the storm, ran again after the switch (no Idempotent-Replayed)", r.key)
			}
		}
	}

	// Every 201 a client saw, on the new primary: the order, and the
	// stored answer byte for byte.
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, c.db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var lost []string
	for id, body := range seen {
		var order struct {
			ID string `json:"id"`
		}
		if err := json.Unmarshal(body, &order); err != nil || order.ID == "" {
			t.Errorf("key %s: 201 body without an order id: %q", id[1], body)
			continue
		}
		var status *int
		var stored []byte
		var orders int
		err := conn.QueryRow(ctx, `SELECT k.response_status, k.response_body,
			(SELECT count(*) FROM orders o WHERE o.id = $3 AND o.user_id = k.user_id AND o.idempotency_key = k.key)
			FROM idempotency_keys k WHERE k.user_id = $1 AND k.key = $2`, id[0], id[1], order.ID).Scan(&status, &stored, &orders)
		switch {
		case err != nil:
			lost = append(lost, fmt.Sprintf("%s: %v", id[1], err))
		case status == nil || *status != http.StatusCreated || !bytes.Equal(stored, body):
			lost = append(lost, fmt.Sprintf("%s: stored %v %q, the client saw 201 %q", id[1], status, stored, body))
		case orders != 1:
			lost = append(lost, fmt.Sprintf("%s: %d orders %s", id[1], orders, order.ID))
		}
	}
	sort.Strings(lost)
	t.Logf("on the new primary: %d of %d keys answered 201 have their order and that stored answer", len(seen)-len(lost), len(seen))
	if len(lost) > 0 {
		t.Errorf("%d answers a client saw are not on the new primary: %v", len(lost), lost[:min(len(lost), 10)])
	}
	if want := failoverKeys + 30; len(seen) != want {
		t.Errorf("%d keys answered 201, want %d", len(seen), want)
	}

	failoverInvariants(t, c, conn)
	c.audit(t)
}

// failoverInvariants checks, over every order so far: no key with two
// orders, one succeeded payment per order, no succeeded payment without
// its order.
func failoverInvariants(t *testing.T, c *chain, conn *pgx.Conn) {
	t.Helper()
	ctx := context.Background()
	var orders, keys int
	if err := conn.QueryRow(ctx, `SELECT count(*), count(DISTINCT (user_id, idempotency_key)) FROM orders`).Scan(&orders, &keys); err != nil {
		t.Fatal(err)
	}
	rows, err := conn.Query(ctx, `SELECT id FROM orders`)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	orderIDs := map[string]bool{}
	for _, id := range ids {
		orderIDs[id] = true
	}
	cl := payments.NewClient(payments.ClientConfig{BaseURL: c.payURL, APIKey: "sk_test_local", HTTPClient: &http.Client{}})
	perOrder := map[string]int{}
	succeeded := 0
	var orphans, twice []string
	for pi, err := range cl.All(ctx) {
		if err != nil {
			t.Fatal(err)
		}
		if pi.Status != "succeeded" {
			continue
		}
		succeeded++
		ref := pi.Metadata["order_ref"]
		perOrder[ref]++
		if !orderIDs[ref] {
			orphans = append(orphans, pi.ID+" ("+ref+")")
		}
	}
	for ref, n := range perOrder {
		if n > 1 {
			twice = append(twice, fmt.Sprintf("%s (%d)", ref, n))
		}
	}
	t.Logf("so far: %d orders for %d keys, %d succeeded payments, %d payments without an order, %d orders paid more than once", orders, keys, succeeded, len(orphans), len(twice))
	if orders != keys {
		t.Errorf("%d orders for %d keys: a key with two orders", orders, keys)
	}
	if succeeded != orders || len(perOrder) != orders {
		t.Errorf("%d succeeded payments for %d distinct orders, %d orders; want one each", succeeded, len(perOrder), orders)
	}
	if len(orphans) > 0 {
		t.Errorf("payments without an order: %v", orphans)
	}
	if len(twice) > 0 {
		t.Errorf("orders paid more than once: %v", twice)
	}
}
