package ordersapp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
)

// demoOptions shape the retry storm.
type demoOptions struct {
	keys       int
	copies     int
	clients    int
	users      int
	latency    time.Duration
	timeout    time.Duration
	timeoutPct int
}

func (a *App) demo(ctx context.Context, args []string) error {
	var o demoOptions
	fs := cli.NewFlagSet("orders demo", "Starts an order service in process (SQLite in a temporary directory, in-process gateway), fires a retry storm at it (duplicate keys, concurrent repeats, client time-outs, retries) and prints what was sent and what was created. Exits 1 unless orders = charges = distinct keys.", a.Getenv)
	fs.Int(&o.keys, "keys", "ORDERS_DEMO_KEYS", 200, 1, 100000, "distinct idempotency keys (operations)")
	fs.Int(&o.copies, "copies", "ORDERS_DEMO_COPIES", 4, 1, 100, "clients sending each key, concurrently")
	fs.Int(&o.clients, "clients", "ORDERS_DEMO_CLIENTS", 32, 1, 1000, "concurrent clients")
	fs.Int(&o.users, "users", "ORDERS_DEMO_USERS", 5, 1, 1000, "users the keys are spread over")
	fs.Duration(&o.latency, "gateway-latency", "ORDERS_DEMO_GATEWAY_LATENCY", 30*time.Millisecond, "latency of the in-process gateway, before each charge")
	fs.Duration(&o.timeout, "client-timeout", "ORDERS_DEMO_CLIENT_TIMEOUT", 10*time.Millisecond, "time-out of the impatient clients, shorter than the gateway latency")
	fs.Int(&o.timeoutPct, "impatient", "ORDERS_DEMO_IMPATIENT", 30, 0, 100, "percent of first attempts sent by an impatient client that times out")
	if err := a.parse(fs, args); err != nil {
		return err
	}
	if max := payments.MaxLatency(payments.DefaultKeyRetention); o.latency >= max {
		return cli.Usagef("--gateway-latency %v is not shorter than %v: a charge must end within its key's lease, at most half the in-process gateway's %v key retention",
			o.latency, max, payments.DefaultKeyRetention)
	}
	dir, err := os.MkdirTemp("", "orders-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)

	c := Config{DataDir: dir, KeyTTL: 24 * time.Hour, RequireKey: true, KeyLease: 30 * time.Second, PaymentsKey: "sk_test_demo", gatewayLatency: o.latency}
	logger := slog.New(slog.NewTextHandler(io.Discard, nil))
	srv, err := a.newServer(ctx, &c, logger)
	if err != nil {
		return err
	}
	defer srv.close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	go func() { _ = srv.run(sctx, ln) }() // a failure shows as the demo's requests failing
	base := "http://" + ln.Addr().String()
	secret, err := c.secret()
	if err != nil {
		return err
	}
	fmt.Fprintf(a.Stderr, "orders demo: server on %s; %d keys x %d concurrent copies from %d clients, %d users\n", base, o.keys, o.copies, o.clients, o.users)

	st, err := storm(ctx, base, secret, o, a.Stderr)
	if err != nil {
		return err
	}
	created, err := countOrders(ctx, base, secret, o.users)
	if err != nil {
		return err
	}
	pis, err := payments.ListAll(ctx, srv.ledger, payments.AccountFor(c.PaymentsKey))
	if err != nil {
		return err
	}
	charges := 0
	for _, pi := range pis {
		if pi.Status == "succeeded" {
			charges++
		}
	}

	tw := tabwriter.NewWriter(a.Stdout, 0, 0, 2, ' ', 0)
	row := func(name string, v int64) { fmt.Fprintf(tw, "%s\t%6d\n", name, v) }
	row("requests sent", st.sent.Load())
	row("distinct keys", int64(o.keys))
	row("orders created", int64(created))
	row("charges made", int64(charges))
	row("201 created", st.created.Load())
	row("replays (Idempotent-Replayed)", st.replays.Load())
	row("409 in flight", st.conflicts.Load())
	row("client time-outs", st.timeouts.Load())
	row("5xx", st.serverErrors.Load())
	row("other answers", st.other.Load())
	tw.Flush()
	if created != o.keys || charges != o.keys || st.serverErrors.Load() != 0 || st.other.Load() != 0 {
		return fmt.Errorf("invariant broken: orders %d, charges %d, distinct keys %d, 5xx %d, other %d", created, charges, o.keys, st.serverErrors.Load(), st.other.Load())
	}
	fmt.Fprintf(a.Stdout, "OK: orders = charges = distinct keys = %d\n", o.keys)
	return nil
}

type stormStats struct {
	sent, created, replays, conflicts, timeouts, serverErrors, other atomic.Int64
}

type task struct {
	user, key string
	body      []byte
}

// storm sends every key from o.copies clients at once; each client retries
// time-outs, 409s and 5xx with the same key until it gets a final answer.
func storm(ctx context.Context, base string, secret []byte, o demoOptions, progress io.Writer) (*stormStats, error) {
	tokens := make([]string, o.users)
	for i := range tokens {
		t, err := orders.IssueToken(secret, fmt.Sprintf("demo-user-%d", i+1), time.Hour, time.Now())
		if err != nil {
			return nil, err
		}
		tokens[i] = t
	}
	tasks := make(chan task)
	go func() {
		defer close(tasks)
		for k := 0; k < o.keys; k++ {
			body, _ := json.Marshal(map[string]any{
				"items":    []map[string]any{{"sku": fmt.Sprintf("SKU-%d", k%17), "quantity": 1 + k%3, "unit_price": 100 + k}},
				"currency": "EUR",
			})
			t := task{user: fmt.Sprint(k % o.users), key: fmt.Sprintf("demo-%d-%d", k, rand.Int64()), body: body}
			for c := 0; c < o.copies; c++ {
				select {
				case tasks <- t:
				case <-ctx.Done():
					return
				}
			}
		}
	}()

	st := new(stormStats)
	var done atomic.Int64
	var wg sync.WaitGroup
	total := int64(o.keys * o.copies)
	fast := &http.Client{Timeout: o.timeout}
	patient := &http.Client{Transport: &client.Transport{
		Base:           countingTransport{st},
		MaxAttempts:    200,
		InitialBackoff: 5 * time.Millisecond,
		MaxBackoff:     50 * time.Millisecond,
		MaxElapsed:     time.Minute,
		OnRetry: func(_ int, resp *http.Response, _ error, _ time.Duration) {
			if resp != nil {
				st.count(resp)
			}
		},
	}}
	var firstErr error
	var errOnce sync.Once
	for w := 0; w < o.clients; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for t := range tasks {
				var idx int
				_, _ = fmt.Sscan(t.user, &idx) // fmt.Sprint of an index, above
				if err := sendUntilFinal(ctx, base, tokens[idx], t, st, fast, patient, o.timeoutPct); err != nil {
					errOnce.Do(func() { firstErr = err })
				}
				if n := done.Add(1); n%500 == 0 || n == total {
					fmt.Fprintf(progress, "orders demo: %d/%d client operations done\n", n, total)
				}
			}
		}()
	}
	wg.Wait()
	return st, firstErr
}

// sendUntilFinal sends t until it gets a final answer: an impatient first
// attempt that may time out, then the retrying client (client.Transport)
// with the same key, which retries 409s, 5xx and dropped connections.
func sendUntilFinal(ctx context.Context, base, token string, t task, st *stormStats, fast, patient *http.Client, impatientPct int) error {
	send := func(c *http.Client) (*http.Response, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/orders", bytes.NewReader(t.body))
		if err != nil {
			return nil, err
		}
		req.Header.Set("Authorization", "Bearer "+token)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", t.key)
		return c.Do(req)
	}
	if rand.IntN(100) < impatientPct {
		st.sent.Add(1)
		resp, err := send(fast)
		var ne net.Error
		switch {
		case err == nil && resp.StatusCode != http.StatusConflict && resp.StatusCode < 500:
			return st.final(resp)
		case err == nil: // in flight or failed: over to the retrying client
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			st.count(resp)
		case errors.As(err, &ne) && ne.Timeout():
			st.timeouts.Add(1)
		default:
			return err
		}
	}
	resp, err := send(patient)
	if err != nil {
		return fmt.Errorf("key %s: %w", t.key, err)
	}
	return st.final(resp)
}

// final counts a final answer.
func (st *stormStats) final(resp *http.Response) error {
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	st.count(resp)
	switch {
	case resp.StatusCode == http.StatusCreated:
		st.created.Add(1)
		if resp.Header.Get("Idempotent-Replayed") == "true" {
			st.replays.Add(1)
		}
	default: // the retrying client gave up on a 409 or 5xx, or another 4xx
		st.other.Add(1)
	}
	return nil
}

// count counts the 409s and 5xx among all answers, retried or final.
func (st *stormStats) count(resp *http.Response) {
	switch {
	case resp.StatusCode == http.StatusConflict:
		st.conflicts.Add(1)
	case resp.StatusCode >= 500:
		st.serverErrors.Add(1)
	}
}

// countingTransport counts the attempts that reach the network.
type countingTransport struct{ st *stormStats }

func (c countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.st.sent.Add(1)
	return http.DefaultTransport.RoundTrip(r)
}

// countOrders counts every demo user's orders through the API.
func countOrders(ctx context.Context, base string, secret []byte, users int) (int, error) {
	n := 0
	for i := 0; i < users; i++ {
		tok, err := orders.IssueToken(secret, fmt.Sprintf("demo-user-%d", i+1), time.Hour, time.Now())
		if err != nil {
			return 0, err
		}
		after := ""
		for {
			url := base + "/v1/orders?limit=100"
			if after != "" {
				url += "&starting_after=" + after
			}
			req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
			req.Header.Set("Authorization", "Bearer "+tok)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return 0, err
			}
			var page struct {
				Orders  []orders.Order `json:"orders"`
				HasMore bool           `json:"has_more"`
			}
			err = json.NewDecoder(resp.Body).Decode(&page)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK {
				return 0, fmt.Errorf("listing orders: status %d: %v", resp.StatusCode, err)
			}
			n += len(page.Orders)
			if !page.HasMore || len(page.Orders) == 0 {
				break
			}
			after = page.Orders[len(page.Orders)-1].ID
		}
	}
	return n, nil
}
