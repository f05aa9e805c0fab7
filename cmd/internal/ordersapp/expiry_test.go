package ordersapp

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
)

// TestExpiryWhileLeased (issue 8, point 2): a key whose TTL (2s) ends while
// its first attempt still runs (the gateway takes 3s, the lease is 10s) is
// not taken by a new operation. A retry at 2.5s is answered 409; once the
// first attempt is done a retry is its replay; one payment, one order, and
// the audit is clean. serve refuses a TTL shorter than the lease, so the
// service is built with its options set directly.
func TestExpiryWhileLeased(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) {
		expiryWhileLeased(t, Config{DataDir: t.TempDir()})
	})
	t.Run("postgres", func(t *testing.T) {
		expiryWhileLeased(t, Config{DataDir: t.TempDir(), DatabaseURL: pgtest.Database(t)})
	})
}

// reply is what one request got.
type reply struct {
	status int
	header http.Header
	body   string
	err    error
	at     time.Duration // when the answer came, from the first request's start
}

func expiryWhileLeased(t *testing.T, c Config) {
	const (
		ttl, lease, latency = 2 * time.Second, 10 * time.Second, 3 * time.Second
		retryAt             = 2500 * time.Millisecond
		payKey              = "sk_test_local"
		user, key           = "expiry-user", "expiry-1"
	)
	c.JWTSecret, c.KeyTTL, c.KeyLease, c.gatewayLatency = testSecret, ttl, lease, latency
	c.RequireKey, c.PaymentsKey = true, payKey
	svc := startInProcess(t, &c)
	tok := token(t, user)
	body := orderBody(1)
	hc := &http.Client{Timeout: 20 * time.Second}
	start := time.Now()
	send := func() reply {
		req, err := http.NewRequest(http.MethodPost, svc.base+"/v1/orders", strings.NewReader(body))
		if err != nil {
			return reply{err: err}
		}
		req.Header.Set("Authorization", "Bearer "+tok)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := hc.Do(req)
		if err != nil {
			return reply{err: err, at: time.Since(start)}
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return reply{status: resp.StatusCode, header: resp.Header, body: string(b), err: err, at: time.Since(start)}
	}

	firstc := make(chan reply, 1)
	go func() { firstc <- send() }()
	time.Sleep(retryAt - time.Since(start)) // not waiting for an outcome: the retry is sent at retryAt, after the TTL and within the lease, by the service's real clock
	retry := send()
	first := <-firstc
	replay := send()
	t.Logf("first attempt: %d at %v; retry sent at %v: %d at %v; retry after the first: %d (Idempotent-Replayed %q) at %v",
		first.status, first.at.Round(time.Millisecond), retryAt, retry.status, retry.at.Round(time.Millisecond),
		replay.status, replay.header.Get("Idempotent-Replayed"), replay.at.Round(time.Millisecond))

	if first.err != nil || first.status != http.StatusCreated {
		t.Errorf("first attempt: %d %v %s, want 201", first.status, first.err, first.body)
	}
	if retry.err != nil || retry.status != http.StatusConflict || retry.header.Get("Retry-After") == "" {
		t.Errorf("retry at %v, after the TTL and within the lease: %d %v (Retry-After %q) %s; want 409 with Retry-After, not a new operation",
			retryAt, retry.status, retry.err, retry.header.Get("Retry-After"), retry.body)
	}
	if replay.err != nil || replay.status != http.StatusCreated || replay.header.Get("Idempotent-Replayed") != "true" || replay.body != first.body {
		t.Errorf("retry after the first attempt: %d %v (Idempotent-Replayed %q)\n%s\nwant the first's replay:\n%s",
			replay.status, replay.err, replay.header.Get("Idempotent-Replayed"), replay.body, first.body)
	}

	// One order, one payment, and it pays for that order.
	var list struct {
		Orders []struct {
			ID        string `json:"id"`
			PaymentID string `json:"payment_id"`
		} `json:"orders"`
	}
	req, _ := http.NewRequest(http.MethodGet, svc.base+"/v1/orders", nil)
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	err = json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	if err != nil {
		t.Fatalf("listing orders: %v", err)
	}
	pis, err := payments.ListAll(context.Background(), svc.srv.ledger, payments.AccountFor(payKey))
	if err != nil {
		t.Fatal(err)
	}
	var succeeded []string
	for _, pi := range pis {
		if pi.Status == "succeeded" {
			succeeded = append(succeeded, pi.ID+" for "+pi.Metadata["order_ref"])
		}
	}
	t.Logf("orders %v; succeeded payments %v", list.Orders, succeeded)
	if len(list.Orders) != 1 || len(succeeded) != 1 {
		t.Errorf("%d orders and %d succeeded payments %v; want one each", len(list.Orders), len(succeeded), succeeded)
	} else if want := list.Orders[0].PaymentID + " for " + list.Orders[0].ID; succeeded[0] != want {
		t.Errorf("payment %s, want %s", succeeded[0], want)
	}

	svc.stop()
	args := []string{"audit", "--data-dir", c.DataDir}
	if c.DatabaseURL != "" {
		args = append(args, "--database-url", c.DatabaseURL)
	}
	code, out, errs := run(t, nil, args...)
	if code != 0 || !strings.Contains(out, "OK: every invariant holds") || !strings.Contains(out, "pending:           0") {
		t.Errorf("orders audit: exit %d\n%s%s", code, out, errs)
	}
}
