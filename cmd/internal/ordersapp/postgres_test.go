package ordersapp

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/testwait"
)

const testSecret = "test-secret-0123456789abcdef0123456789"

func token(t *testing.T, user string) string {
	t.Helper()
	tok, err := issue(user)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func issue(user string) (string, error) {
	return orders.IssueToken([]byte(testSecret), user, time.Hour, time.Now())
}

func orderBody(i int) string {
	return fmt.Sprintf(`{"items":[{"sku":"SKU-%d","quantity":%d,"unit_price":%d}],"currency":"EUR"}`, i%7, 1+i%3, 100+i)
}

func countRows(t *testing.T, dbURL, query string) int {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var n int
	if err := conn.QueryRow(ctx, query).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

// TestMultiInstancePostgres: three `orders serve` processes on one
// database; 200 keys, each sent 8 times at once, spread over the three.
// Exactly 200 orders and 200 payments, no 5xx, and the audit is clean.
func TestMultiInstancePostgres(t *testing.T) {
	t.Parallel()
	t.Run("postgres", func(t *testing.T) { multiInstance(t, "") })
	t.Run("postgres+redis", func(t *testing.T) { multiInstance(t, redisURL(t)) })
}

// redisURL returns the address of the Redis the tests may use, or skips t.
func redisURL(t *testing.T) string {
	t.Helper()
	u := os.Getenv("TEST_REDIS_URL")
	if u == "" {
		if os.Getenv("CI") != "true" {
			t.Skip("Redis tests skipped: set TEST_REDIS_URL (e.g. redis://127.0.0.1:6379) or CI=true")
		}
		u = "redis://127.0.0.1:6379"
	}
	rdb, err := newRedis(u)
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		t.Fatalf("Redis at %s does not answer: %v", u, err)
	}
	return u
}

func multiInstance(t *testing.T, redis string) {
	dbURL := pgtest.Database(t)
	ordersBin, _ := binaries(t)
	dir := t.TempDir()
	natsURL := testNATS(t) // one NATS for the three instances
	var bases []string
	for i := 0; i < 3; i++ {
		addr := freeAddr(t)
		args := []string{"serve", "--addr", addr, "--data-dir", dir, "--database-url", dbURL, "--jwt-secret", testSecret, "--nats-url", natsURL}
		if redis != "" {
			args = append(args, "--redis-url", redis)
		}
		start(t, "http://"+addr+"/healthz", ordersBin, args...)
		bases = append(bases, "http://"+addr)
	}
	run := fmt.Sprint(time.Now().UnixNano()) // keys of their own in a shared Redis

	const keys, copies = 200, 8
	var fivexx, conflicts, sent atomic.Int64
	statuses := make(chan int, keys*copies)
	hc := &http.Client{Transport: &client.Transport{
		MaxAttempts: 50, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 200 * time.Millisecond, MaxElapsed: time.Minute,
		OnRetry: func(_ int, resp *http.Response, err error, _ time.Duration) {
			switch {
			case resp != nil && resp.StatusCode >= 500:
				fivexx.Add(1)
			case resp != nil && resp.StatusCode == http.StatusConflict:
				conflicts.Add(1)
			}
		},
		Base: &attemptCounter{n: &sent},
	}}
	var wg sync.WaitGroup
	for k := 0; k < keys; k++ {
		user := fmt.Sprintf("user-%d", k%10)
		tok := token(t, user)
		for c := 0; c < copies; c++ {
			wg.Add(1)
			go func(k, c int) {
				defer wg.Done()
				req, _ := http.NewRequest("POST", bases[(k+c)%3]+"/v1/orders", strings.NewReader(orderBody(k)))
				req.Header.Set("Authorization", "Bearer "+tok)
				req.Header.Set("Idempotency-Key", fmt.Sprintf("multi-%s-%d", run, k))
				resp, err := hc.Do(req)
				if err != nil {
					t.Errorf("key %d copy %d: %v", k, c, err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode >= 500 {
					fivexx.Add(1)
				}
				statuses <- resp.StatusCode
			}(k, c)
		}
	}
	wg.Wait()
	close(statuses)
	byStatus := map[int]int{}
	for s := range statuses {
		byStatus[s]++
	}
	gotOrders := countRows(t, dbURL, `SELECT count(*) FROM orders`)
	gotPayments := countRows(t, dbURL, `SELECT count(*) FROM payments.payment_intents WHERE status = 'succeeded'`)
	t.Logf("multi-instance: %d requests sent (%d copies x %d keys, retries included), final statuses %v, 409s retried %d, 5xx %d; orders %d, payments %d",
		sent.Load(), copies, keys, byStatus, conflicts.Load(), fivexx.Load(), gotOrders, gotPayments)
	if byStatus[201] != keys*copies {
		t.Errorf("final statuses %v, want all %d to be 201", byStatus, keys*copies)
	}
	if fivexx.Load() != 0 {
		t.Errorf("5xx answers: %d, want 0", fivexx.Load())
	}
	if gotOrders != keys || gotPayments != keys {
		t.Errorf("orders %d, payments %d; want %d each", gotOrders, gotPayments, keys)
	}
	out, err := exec.Command(ordersBin, "audit", "--database-url", dbURL, "--data-dir", dir, "--nats-url", natsURL).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "OK: every invariant holds") {
		t.Errorf("orders audit: %v\n%s", err, out)
	}
	t.Logf("orders audit:\n%s", out)
	if redis != "" {
		for _, b := range bases {
			resp, err := http.Get(b + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			m, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var lines []string
			for _, l := range strings.Split(string(m), "\n") {
				if strings.HasPrefix(l, "idem_redis_") {
					lines = append(lines, l)
				}
			}
			t.Logf("%s: %s", b, strings.Join(lines, ", "))
		}
	}
}

// attemptCounter counts the attempts that reach the network.
type attemptCounter struct{ n *atomic.Int64 }

func (c *attemptCounter) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return http.DefaultTransport.RoundTrip(r)
}

// TestInFlightLatencyPostgres measures how fast a duplicate is refused while
// the first attempt holds its lease (the gateway takes 500ms). The contract
// asks for 409 at once; the figures are reported, not asserted.
func TestInFlightLatencyPostgres(t *testing.T) {
	dbURL := pgtest.Database(t)
	ordersBin, paymentsBin := binaries(t)
	payAddr, ordAddr := freeAddr(t), freeAddr(t)
	start(t, "http://"+payAddr+"/v1/payment_intents", paymentsBin, "serve", "--addr", payAddr, "--latency", "500ms")
	start(t, "http://"+ordAddr+"/healthz", ordersBin, "serve", "--addr", ordAddr, "--data-dir", t.TempDir(),
		"--database-url", dbURL, "--jwt-secret", testSecret, "--payments-url", "http://"+payAddr)
	tok := token(t, "latency")
	base := "http://" + ordAddr

	send := func(key string) (int, time.Duration) {
		req, _ := http.NewRequest("POST", base+"/v1/orders", strings.NewReader(orderBody(1)))
		req.Header.Set("Authorization", "Bearer "+tok)
		req.Header.Set("Idempotency-Key", key)
		t0 := time.Now()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Errorf("%s: %v", key, err)
			return 0, 0
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, time.Since(t0)
	}
	send("warm-up")
	const rounds, dups = 20, 10
	var lat []time.Duration
	for r := 0; r < rounds; r++ {
		key := fmt.Sprintf("latency-%d", r)
		first := make(chan int)
		go func() { s, _ := send(key); first <- s }()
		testwait.Until(t, 0, key+"'s first attempt to hold its key", func() bool {
			return countRows(t, dbURL, `SELECT count(*) FROM public.idempotency_keys WHERE key = '`+key+`' AND response_status IS NULL`) == 1
		})
		for d := 0; d < dups; d++ {
			s, el := send(key)
			if s != http.StatusConflict {
				t.Fatalf("duplicate in flight: %d, want 409", s)
			}
			lat = append(lat, el)
		}
		if s := <-first; s != http.StatusCreated {
			t.Fatalf("first attempt: %d", s)
		}
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	p := func(q float64) time.Duration { return lat[int(q*float64(len(lat)-1))] }
	t.Logf("409 latency over %d duplicates in flight (PostgreSQL, one instance): p50 %v, p99 %v, max %v",
		len(lat), p(0.50), p(0.99), lat[len(lat)-1])
}

// TestGCMillionExpiredKeys: `orders gc` deletes 1,000,000 expired keys in
// batches while orders are being created; live keys and orders stay.
func TestGCMillionExpiredKeys(t *testing.T) {
	// Judged by its outcome (what is deleted and what stays), not by how
	// fast: it runs beside the package's other parallel tests.
	t.Parallel()
	dbURL := pgtest.Database(t)
	ordersBin, _ := binaries(t)
	addr := freeAddr(t)
	start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", t.TempDir(),
		"--database-url", dbURL, "--jwt-secret", testSecret)

	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	const expired = 1_000_000
	t0 := time.Now()
	_, err = conn.Exec(ctx, `INSERT INTO idempotency_keys
		(user_id, key, fingerprint, method, path, owner, lease_until, attempts, response_status, response_body, created_at, completed_at, expires_at)
		SELECT 'gc-user-' || (g % 1000), 'old-' || g, 'fp', 'POST', '/v1/orders', 'o', now() - interval '2 days', 1, 201, '\x7b7d',
		       now() - interval '2 days', now() - interval '2 days', now() - interval '1 day' - (g || ' seconds')::interval
		FROM generate_series(1, $1) AS g`, expired)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("inserted %d expired keys in %v", expired, time.Since(t0).Round(time.Millisecond))

	// A load runs meanwhile.
	stop := make(chan struct{})
	var created, failed atomic.Int64
	var wg sync.WaitGroup
	tok := token(t, "gc-load")
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				req, _ := http.NewRequest("POST", "http://"+addr+"/v1/orders", strings.NewReader(orderBody(i)))
				req.Header.Set("Authorization", "Bearer "+tok)
				req.Header.Set("Idempotency-Key", fmt.Sprintf("load-%d-%d", w, i))
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					failed.Add(1)
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode == http.StatusCreated {
					created.Add(1)
				} else {
					failed.Add(1)
				}
			}
		}(w)
	}
	t1 := time.Now()
	out, err := exec.Command(ordersBin, "gc", "--database-url", dbURL, "--data-dir", t.TempDir()).Output()
	el := time.Since(t1)
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatalf("orders gc: %v\n%s", err, out)
	}
	// The instance's own cleaner may take a share when its minute comes.
	var deleted int
	if _, err := fmt.Sscanf(string(out), "deleted %d expired keys", &deleted); err != nil || deleted <= 0 || deleted > expired {
		t.Errorf("orders gc said %q, want up to %d deleted", out, expired)
	}
	left := countRows(t, dbURL, `SELECT count(*) FROM idempotency_keys WHERE expires_at <= now()`)
	live := countRows(t, dbURL, `SELECT count(*) FROM idempotency_keys WHERE user_id = 'gc-load'`)
	orderRows := countRows(t, dbURL, `SELECT count(*) FROM orders WHERE user_id = 'gc-load'`)
	t.Logf("orders gc: %s; wall time %v = %.0f keys/s; load meanwhile: %d orders created, %d failed",
		strings.TrimSpace(string(out)), el.Round(time.Millisecond), float64(deleted)/el.Seconds(), created.Load(), failed.Load())
	if left != 0 || failed.Load() != 0 || live != int(created.Load()) || orderRows != int(created.Load()) {
		t.Errorf("after gc: %d expired left, %d failed requests, %d live keys and %d orders for %d created; want 0, 0 and equal", left, failed.Load(), live, orderRows, created.Load())
	}
}
