package ordersapp

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	neturl "net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
)

// Clock skew (issue 10, point 4). Two instances on one PostgreSQL
// database, one whose clock runs 5 minutes ahead and one 5 minutes
// behind (Config.testClock: what the order handler reads as the time).
// Leases, takeovers, expiry, the cleaner and the completer's backoff must
// follow the database's clock. Every other instance-clock read in the
// request path is a duration on the monotonic clock (see the report).
//
// The instances here serve HTTP only (skewInstance): no background
// completer or cleaner, whose runs the tests make themselves, so that
// nothing but the database's clock decides when they act.

const skewShift = 5 * time.Minute

// skewInstance is an order service built by newServer from c, serving
// its API on a loopback port without its background loops.
type skewInstance struct {
	srv  *server
	base string
	logs *syncBuffer
}

func skewStart(t *testing.T, c *Config) *skewInstance {
	t.Helper()
	logs := new(syncBuffer)
	srv, err := (&App{}).newServer(context.Background(), c, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatalf("newServer: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		srv.close()
		t.Fatal(err)
	}
	hs := newHTTPServer(srv.handler)
	go hs.Serve(ln)
	t.Cleanup(func() {
		hs.Close()
		srv.close()
		if t.Failed() {
			t.Logf("instance logs:\n%s", tail(logs.String(), 30))
		}
	})
	return &skewInstance{srv: srv, base: "http://" + ln.Addr().String(), logs: logs}
}

// skewGateway is a Stripe-like gateway (the real handler, in memory)
// in front of which a test may hold the next charge, or refuse charges.
type skewGateway struct {
	url      string
	gw       *payments.Server
	mu       sync.Mutex
	hold     chan struct{} // armed: the next charge waits on it
	entered  chan struct{} // closed when the held charge arrived
	refusing atomic.Bool   // charges answered 400
	blind    atomic.Bool   // searches answered 500
}

func skewNewGateway(t *testing.T) *skewGateway {
	g := &skewGateway{gw: payments.NewServer(payments.Config{APIKey: "sk_test_local"})}
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if g.blind.Load() && strings.HasSuffix(r.URL.Path, "/search") {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusInternalServerError)
			io.WriteString(w, `{"error":{"type":"api_error","message":"search down (test)"}}`)
			return
		}
		if r.Method == http.MethodPost && r.URL.Path == "/v1/payment_intents" {
			if g.refusing.Load() {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusBadRequest)
				io.WriteString(w, `{"error":{"type":"invalid_request_error","message":"refused by the test"}}`)
				return
			}
			g.mu.Lock()
			hold, entered := g.hold, g.entered
			g.hold = nil
			g.mu.Unlock()
			if hold != nil {
				close(entered)
				<-hold
			}
		}
		g.gw.ServeHTTP(w, r)
	}))
	t.Cleanup(hs.Close)
	g.url = hs.URL
	return g
}

// holdNext makes the next charge wait until release is called; entered
// is closed when it arrives.
func (g *skewGateway) holdNext() (entered <-chan struct{}, release func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	hold, in := make(chan struct{}), make(chan struct{})
	g.hold, g.entered = hold, in
	return in, sync.OnceFunc(func() { close(hold) })
}

// succeeded counts the gateway's succeeded PaymentIntents.
func (g *skewGateway) succeeded(t *testing.T) int {
	t.Helper()
	cl := payments.NewClient(payments.ClientConfig{BaseURL: g.url, APIKey: "sk_test_local", HTTPClient: &http.Client{}})
	n := 0
	for pi, err := range cl.All(context.Background()) {
		if err != nil {
			t.Fatal(err)
		}
		if pi.Status == "succeeded" {
			n++
		}
	}
	return n
}

// skewPair starts the instance ahead (+5 min) and the one behind (−5
// min) on a fresh database, paying through g, with the given key TTL.
func skewPair(t *testing.T, g *skewGateway, ttl time.Duration) (db string, ahead, behind *skewInstance) {
	t.Helper()
	db = pgtest.Database(t)
	dir := t.TempDir()
	natsURL := testNATS(t) // one NATS for the two instances
	mk := func(shift time.Duration) *Config {
		return &Config{
			DatabaseURL: db, DataDir: dir, JWTSecret: testSecret, PaymentsURL: g.url, PaymentsKey: "sk_test_local", NATSURL: natsURL,
			KeyTTL: ttl, KeyLease: 30 * time.Second, RequireKey: true,
			testClock: func() time.Time { return time.Now().Add(shift) },
		}
	}
	ahead = skewStart(t, mk(skewShift))
	behind = skewStart(t, mk(-skewShift))
	return db, ahead, behind
}

// skewClient bounds every request of these tests.
var skewClient = &http.Client{Timeout: 90 * time.Second}

// skewPost sends one order and returns its status and whether it was a
// replay; 0 when it failed in transit. Safe in a goroutine.
func skewPost(base, user, key, body string) (int, bool) {
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/orders", strings.NewReader(body))
	tok, _ := issue(user)
	req.Header.Set("Authorization", "Bearer "+tok)
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := skewClient.Do(req)
	if err != nil {
		return 0, false
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed") == "true"
}

// skewRow is the idempotency record of (user, key), as the database has it.
type skewRow struct {
	exists             bool
	status             int
	attempts, redrives int
	leaseLeft          time.Duration // lease_until − the database's now
}

func skewRecord(t *testing.T, db, user, key string) skewRow {
	t.Helper()
	n := countRows(t, db, fmt.Sprintf(`SELECT count(*) FROM idempotency_keys WHERE user_id = '%s' AND key = '%s'`, user, key))
	if n == 0 {
		return skewRow{}
	}
	r := skewRow{exists: true}
	r.status = countRows(t, db, fmt.Sprintf(`SELECT coalesce(response_status, 0) FROM idempotency_keys WHERE user_id = '%s' AND key = '%s'`, user, key))
	r.attempts = countRows(t, db, fmt.Sprintf(`SELECT attempts FROM idempotency_keys WHERE user_id = '%s' AND key = '%s'`, user, key))
	r.redrives = countRows(t, db, fmt.Sprintf(`SELECT redrives FROM idempotency_keys WHERE user_id = '%s' AND key = '%s'`, user, key))
	ms := countRows(t, db, fmt.Sprintf(`SELECT (extract(epoch FROM lease_until - statement_timestamp()) * 1000)::bigint FROM idempotency_keys WHERE user_id = '%s' AND key = '%s'`, user, key))
	r.leaseLeft = time.Duration(ms) * time.Millisecond
	return r
}

// TestSkewHeldLeaseFollowsDatabase: the instance 5 minutes behind holds a
// key (its charge waits at the gateway). The instance 5 minutes ahead
// answers every repeat 409, its completer does not list the key, and its
// cleaner deletes nothing: by the database's clock the 30 s lease is
// live. Then the lease ends by the database's clock (lease_until moved to
// the database's now): a retry through the instance behind, whose own
// clock would give the lease 5 more minutes, takes it over at once and
// commits; the held attempt, released, is fenced (409). One order, one
// payment, and the instance ahead replays the answer.
func TestSkewHeldLeaseFollowsDatabase(t *testing.T) {
	g := skewNewGateway(t)
	db, ahead, behind := skewPair(t, g, 24*time.Hour)
	ctx := context.Background()
	const user, key = "skew-user", "skew-held"
	body := orderBody(1)

	entered, release := g.holdNext()
	defer release()
	held := make(chan int, 1)
	go func() { s, _ := skewPost(behind.base, user, key, body); held <- s }()
	select {
	case <-entered:
	case s := <-held:
		t.Fatalf("the first attempt answered %d before reaching the gateway", s)
	case <-time.After(30 * time.Second):
		t.Fatal("the first attempt never reached the gateway")
	}

	statuses := map[int]int{}
	for range 5 {
		s, _ := skewPost(ahead.base, user, key, body)
		statuses[s]++
	}
	st, err := ahead.srv.completer.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	swept, err := ahead.srv.backend.sweeper.DeleteExpired(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	row := skewRecord(t, db, user, key)
	t.Logf("held lease (%v left by the database's clock): the instance ahead answered %v; its completer %+v; its cleaner deleted %d; record %+v", row.leaseLeft, statuses, st, swept, row)
	if statuses[http.StatusConflict] != 5 {
		t.Errorf("repeats on the instance 5 min ahead: %v, want 5 × 409", statuses)
	}
	if st.Scanned != 0 || swept != 0 || !row.exists || row.attempts != 1 || row.status != 0 {
		t.Errorf("the instance ahead touched a live lease: completer %+v, cleaner %d, record %+v", st, swept, row)
	}

	// The lease ends by the database's clock.
	pgExec(t, db, fmt.Sprintf(`UPDATE idempotency_keys SET lease_until = statement_timestamp() - interval '1 millisecond' WHERE user_id = '%s' AND key = '%s'`, user, key))
	first, replayed := skewPost(behind.base, user, key, body)
	row = skewRecord(t, db, user, key)
	if first != http.StatusCreated || replayed || row.status != http.StatusCreated || row.attempts != 2 {
		t.Errorf("retry on the instance 5 min behind once the lease ended by the database's clock: %d (replayed %v), record %+v; want a takeover that commits (201, attempt 2)", first, replayed, row)
	}
	release()
	var heldStatus int
	select {
	case heldStatus = <-held:
	case <-time.After(60 * time.Second):
		t.Fatal("the held attempt never answered")
	}
	again, replayed := skewPost(ahead.base, user, key, body)
	orders := countRows(t, db, fmt.Sprintf(`SELECT count(*) FROM orders WHERE user_id = '%s'`, user))
	pays := g.succeeded(t)
	t.Logf("takeover by the instance behind: %d; the held attempt, released: %d; replay on the instance ahead: %d (replayed %v); orders %d, succeeded payments %d",
		first, heldStatus, again, replayed, orders, pays)
	if heldStatus != http.StatusConflict {
		t.Errorf("the held attempt, taken over, answered %d; want 409 (fenced, or its order already made)", heldStatus)
	}
	if again != http.StatusCreated || !replayed || orders != 1 || pays != 1 {
		t.Errorf("after the race: replay %d (replayed %v), %d orders, %d payments; want a 201 replay, 1 and 1", again, replayed, orders, pays)
	}
}

// TestSkewExpiryFollowsDatabase: keys live 2 minutes (less than the
// skew). A key answered through the instance behind is not expired for
// the instance ahead (another body: 422; the same: a replay) nor for its
// cleaner. Once its expiry passes by the database's clock (expires_at
// moved to the database's now), the instance behind, whose own clock
// would give it 5 more minutes, starts a new operation on it at once,
// and its cleaner deletes another expired key at once.
func TestSkewExpiryFollowsDatabase(t *testing.T) {
	g := skewNewGateway(t)
	db, ahead, behind := skewPair(t, g, 2*time.Minute)
	ctx := context.Background()
	const user = "skew-exp"
	if s, _ := skewPost(behind.base, user, "e1", orderBody(1)); s != http.StatusCreated {
		t.Fatalf("first order through the instance behind: %d", s)
	}
	other, _ := skewPost(ahead.base, user, "e1", orderBody(2))
	same, replayed := skewPost(ahead.base, user, "e1", orderBody(1))
	swept, err := ahead.srv.backend.sweeper.DeleteExpired(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("live key on the instance ahead: another body %d, the same %d (replayed %v); its cleaner deleted %d", other, same, replayed, swept)
	if other != http.StatusUnprocessableEntity || same != http.StatusCreated || !replayed || swept != 0 || !skewRecord(t, db, user, "e1").exists {
		t.Errorf("the instance 5 min ahead saw a 2-minute key expired early: 422? %d, replay? %d %v, deleted %d", other, same, replayed, swept)
	}

	if s, _ := skewPost(behind.base, user, "e2", orderBody(3)); s != http.StatusCreated {
		t.Fatalf("order e2: %d", s)
	}
	pgExec(t, db, fmt.Sprintf(`UPDATE idempotency_keys SET expires_at = statement_timestamp() - interval '1 millisecond' WHERE user_id = '%s'`, user))
	next, replayed := skewPost(behind.base, user, "e1", orderBody(2))
	swept, err = behind.srv.backend.sweeper.DeleteExpired(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	orders := countRows(t, db, fmt.Sprintf(`SELECT count(*) FROM orders WHERE user_id = '%s' AND idempotency_key = 'e1'`, user))
	t.Logf("expired by the database's clock, on the instance behind: another body %d (replayed %v), orders for e1 %d; its cleaner deleted %d", next, replayed, orders, swept)
	if next != http.StatusCreated || replayed || orders != 2 {
		t.Errorf("the instance 5 min behind kept an expired key: %d (replayed %v), %d orders for e1; want a new operation (201) and 2 orders", next, replayed, orders)
	}
	if swept != 1 || skewRecord(t, db, user, "e2").exists {
		t.Errorf("the cleaner of the instance behind deleted %d expired keys, want 1 (e2)", swept)
	}
}

// TestSkewCompleterFollowsDatabase: a key whose attempt failed (the
// gateway refused the charge: 502, the key kept) has been re-driven 5
// times, so its next re-drive is due 16 s after its lease ended; it ended
// 2 s ago by the database's clock. Neither the completer of the instance
// 5 minutes ahead nor that of the one behind re-drives it. Once the
// lease ended 17 s ago by the database's clock, the completer ahead
// re-drives it (the gateway accepting again) and it completes once.
func TestSkewCompleterFollowsDatabase(t *testing.T) {
	g := skewNewGateway(t)
	db, ahead, behind := skewPair(t, g, 24*time.Hour)
	ctx := context.Background()
	const user, key = "skew-redrive", "r1"
	g.refusing.Store(true)
	if s, _ := skewPost(ahead.base, user, key, orderBody(4)); s != http.StatusBadGateway {
		t.Fatalf("order with the charge refused: %d, want 502", s)
	}
	pgExec(t, db, fmt.Sprintf(`UPDATE idempotency_keys SET redrives = 5, lease_until = statement_timestamp() - interval '2 seconds' WHERE user_id = '%s' AND key = '%s'`, user, key))
	before := skewRecord(t, db, user, key)
	stAhead, err := ahead.srv.completer.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stBehind, err := behind.srv.completer.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	after := skewRecord(t, db, user, key)
	t.Logf("in its backoff by the database's clock: completer ahead %+v, behind %+v; record before %+v, after %+v", stAhead, stBehind, before, after)
	if stAhead.Scanned != 0 || stBehind.Scanned != 0 || after.redrives != 5 || after.attempts != before.attempts {
		t.Errorf("a completer re-drove a key in its backoff: ahead %+v, behind %+v, record %+v", stAhead, stBehind, after)
	}

	g.refusing.Store(false)
	pgExec(t, db, fmt.Sprintf(`UPDATE idempotency_keys SET lease_until = statement_timestamp() - interval '17 seconds' WHERE user_id = '%s' AND key = '%s'`, user, key))
	stAhead, err = ahead.srv.completer.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	after = skewRecord(t, db, user, key)
	replay, replayed := skewPost(behind.base, user, key, orderBody(4))
	orders := countRows(t, db, fmt.Sprintf(`SELECT count(*) FROM orders WHERE user_id = '%s'`, user))
	t.Logf("due by the database's clock: completer ahead %+v; record %+v; client's retry on the instance behind %d (replayed %v); orders %d, payments %d", stAhead, after, replay, replayed, orders, g.succeeded(t))
	if stAhead.Completed != 1 || after.status != http.StatusCreated || after.redrives != 6 {
		t.Errorf("the due re-drive: %+v, record %+v; want it completed (201, 6 re-drives)", stAhead, after)
	}
	if replay != http.StatusCreated || !replayed || orders != 1 || g.succeeded(t) != 1 {
		t.Errorf("after the re-drive: %d (replayed %v), %d orders; want the replay and one order, one payment", replay, replayed, orders)
	}
}

// TestSkewPaymentLookupWindow: the one decision about money that reads
// the instance's own clock. An attempt after an operation's first looks
// its payment up; when the lookup fails, it pays with the operation's key
// only if the operation (created at the database's time) is younger than
// the gateway's key retention less a margin for skew, 24 h − 1 h, by the
// instance's clock. Here the operation is 22 h 58 min old by the
// database's clock and the gateway's search is down: the instance 5 min
// ahead reads 23 h 03 min and answers 502 without paying (safe: nothing
// charged, nothing stored); the one 5 min behind reads 22 h 53 min and
// pays with the key, which the gateway keeps for 24 h, 62 min more: a
// skew under the 1 h margin moves the boundary but never past the
// retention.
func TestSkewPaymentLookupWindow(t *testing.T) {
	g := skewNewGateway(t)
	db, ahead, behind := skewPair(t, g, 24*time.Hour)
	const user, key = "skew-window", "w1"
	g.refusing.Store(true)
	if s, _ := skewPost(ahead.base, user, key, orderBody(5)); s != http.StatusBadGateway {
		t.Fatalf("order with the charge refused: %d, want 502", s)
	}
	g.refusing.Store(false)
	g.blind.Store(true)
	pgExec(t, db, fmt.Sprintf(`UPDATE idempotency_keys SET created_at = statement_timestamp() - interval '22 hours 58 minutes', lease_until = statement_timestamp() - interval '1 millisecond' WHERE user_id = '%s' AND key = '%s'`, user, key))
	onAhead, _ := skewPost(ahead.base, user, key, orderBody(5))
	paidAhead := g.succeeded(t)
	onBehind, _ := skewPost(behind.base, user, key, orderBody(5))
	paid := g.succeeded(t)
	orders := countRows(t, db, fmt.Sprintf(`SELECT count(*) FROM orders WHERE user_id = '%s'`, user))
	t.Logf("operation 22h58m old by the database, search down: instance ahead %d (payments %d), instance behind %d (payments %d, orders %d)", onAhead, paidAhead, onBehind, paid, orders)
	if onAhead != http.StatusBadGateway || paidAhead != 0 || !strings.Contains(ahead.logs.String(), "the gateway may have forgotten its payment key") {
		t.Errorf("the instance ahead: %d with %d payments; want 502 and none, refused for the operation's age", onAhead, paidAhead)
	}
	if onBehind != http.StatusCreated || paid != 1 || orders != 1 {
		t.Errorf("the instance behind: %d, %d payments, %d orders; want 201, 1, 1", onBehind, paid, orders)
	}
}

// TestSkewSerializableOrderService: two order services (the in-process
// gateway in the same database) whose every transaction is SERIALIZABLE
// (options=-c default_transaction_isolation=serializable in the URL);
// 30 keys, each sent 4 times at once spread over both, through the
// retrying client. Every key ends 201; 30 orders, 30 succeeded payments,
// the audit clean. The answers the client retried (409 in flight, 503
// after serialization failures) are counted.
func TestSkewSerializableOrderService(t *testing.T) {
	db := pgtest.Database(t)
	u, err := neturl.Parse(db)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("options", "-c default_transaction_isolation=serializable")
	u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20") // pgx reads a + as itself
	serial := u.String()
	if n := countRows(t, serial, `SELECT CASE WHEN current_setting('default_transaction_isolation') = 'serializable' THEN 1 ELSE 0 END`); n != 1 {
		t.Fatal("the URL's options did not make transactions SERIALIZABLE")
	}
	dir := t.TempDir()
	natsURL := testNATS(t) // one NATS for the two instances
	var bases []string
	var insts []*inProcess
	for range 2 {
		in := startInProcess(t, &Config{DatabaseURL: serial, DataDir: dir, JWTSecret: testSecret, PaymentsKey: "sk_test_local", NATSURL: natsURL,
			KeyTTL: 24 * time.Hour, KeyLease: 30 * time.Second, RequireKey: true})
		insts = append(insts, in)
		bases = append(bases, in.base)
	}
	var mu sync.Mutex
	raw := map[int]int{}
	counting := skewRoundTripFunc(func(r *http.Request) (*http.Response, error) {
		resp, err := http.DefaultTransport.RoundTrip(r)
		mu.Lock()
		if err != nil {
			raw[0]++
		} else {
			raw[resp.StatusCode]++
		}
		mu.Unlock()
		return resp, err
	})
	hc := &http.Client{Transport: &client.Transport{Base: counting, MaxAttempts: 40, InitialBackoff: 20 * time.Millisecond, MaxBackoff: 500 * time.Millisecond, MaxElapsed: time.Minute}}
	const keys, copies = 30, 4
	final := map[int]int{}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 12)
	for k := range keys {
		for c := range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sem <- struct{}{}
				defer func() { <-sem }()
				s, _ := post(hc, bases[(k+c)%2], "ser-user", fmt.Sprintf("ser-%d", k), k)
				mu.Lock()
				final[s]++
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	orders := countRows(t, db, `SELECT count(*) FROM orders`)
	rep, err := runAudit(context.Background(), insts[0].srv.backend, insts[0].srv.payer, insts[0].srv.broker.js, nil)
	if err != nil {
		t.Fatal(err)
	}
	var retries, storeErrs int64
	for _, in := range insts {
		retries += in.srv.metrics.StoreRetries.Load()
		storeErrs += in.srv.metrics.StoreErrors.Load()
	}
	t.Logf("SERIALIZABLE: %d keys × %d copies over 2 instances: final answers %v; every answer seen by the client %v; store calls resent %d, store errors answered %d; orders %d, succeeded payments %d, audit violations %v",
		keys, copies, final, raw, retries, storeErrs, orders, rep.ChargesSucceeded, rep.Violations)
	if final[http.StatusCreated] != keys*copies {
		t.Errorf("final answers %v, want %d × 201", final, keys*copies)
	}
	if orders != keys || rep.ChargesSucceeded != keys || len(rep.Violations) != 0 || len(rep.Pending) != 0 {
		t.Errorf("orders %d, payments %d, violations %v, pending %v; want %d, %d, none, none", orders, rep.ChargesSucceeded, rep.Violations, rep.Pending, keys, keys)
	}
}

type skewRoundTripFunc func(*http.Request) (*http.Response, error)

func (f skewRoundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
