package ordersapp

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"

	"github.com/idem-go/idem/cmd/internal/orders"
)

// Hostile clients against the real binaries (issue 10, point 6): `orders
// serve` (SQLite, in-process gateway) and `payments serve`, and for the
// slow handler an `orders serve` paying through a `payments serve
// --latency 15s`. The bounds are serve's fixed ones: headers within 10 s,
// the whole request within 30 s, 64 KiB of headers. Every wait is
// bounded; the assertions count bytes and statuses, not milliseconds.

// slowMarkers are in the keys and bodies sent, and must never show in
// a log.
const (
	slowKeyMarker  = "hostile2-SECRET-KEY"
	slowBodyMarker = "hostile2-SECRET-SKU"
)

func slowOrderBody(i int) string {
	return fmt.Sprintf(`{"items":[{"sku":"%s-%d","quantity":1,"unit_price":%d}],"currency":"EUR"}`, slowBodyMarker, i, 100+i)
}

const slowPaymentForm = "amount=1234&currency=eur&payment_method=pm_card_visa&confirm=true&metadata[order_ref]=" + slowBodyMarker

// slowloris sends a request's headers one byte a second and
// reports how many bytes of its last header line it had sent when the
// server closed the connection (closed false: never, all sent).
func slowloris(addr string) (sent, total int, closed bool) {
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		return 0, 0, false
	}
	defer conn.Close()
	fmt.Fprintf(conn, "GET /healthz HTTP/1.1\r\nHost: %s\r\n", addr)
	done := make(chan struct{})
	go func() { io.Copy(io.Discard, conn); close(done) }()
	line := "X-Slow: " + strings.Repeat("s", 40) + "\r\n\r\n"
	for i := range len(line) {
		select {
		case <-done:
			return i, len(line), true
		case <-time.After(time.Second):
		}
		if _, err := conn.Write([]byte{line[i]}); err != nil {
			return i, len(line), true
		}
	}
	select {
	case <-done:
		return len(line), len(line), true
	case <-time.After(5 * time.Second):
		return len(line), len(line), false
	}
}

// slowExchange writes head, then the body in parts with pause
// between them (stopping after stopAfter parts, the connection left open,
// when stopAfter >= 0), and reads the answer, for at most 90 s. status is
// the answer's status, 0 when the server closed without one; cut reports
// whether the server ended the exchange before the body was all sent.
func slowExchange(addr, head string, parts []string, pause time.Duration, stopAfter int) (status int, body string, cut bool, err error) {
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		return 0, "", false, err
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(90 * time.Second)); err != nil {
		return 0, "", false, err
	}
	type answer struct {
		status int
		body   string
		err    error
	}
	got := make(chan answer, 1)
	go func() {
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			got <- answer{err: err}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		got <- answer{status: resp.StatusCode, body: string(b)}
	}()
	if _, err := io.WriteString(conn, head); err != nil {
		a := <-got // the server may have answered and closed (431)
		return a.status, a.body, true, a.err
	}
	for i, p := range parts {
		if stopAfter >= 0 && i >= stopAfter {
			a := <-got // the rest is never sent
			if a.err != nil && !errors.Is(a.err, io.EOF) && !errors.Is(a.err, io.ErrUnexpectedEOF) && !strings.Contains(a.err.Error(), "reset") {
				return 0, "", false, a.err
			}
			return a.status, a.body, true, nil
		}
		if i > 0 {
			select {
			case a := <-got:
				return a.status, a.body, true, a.err
			case <-time.After(pause):
			}
		}
		if _, err := io.WriteString(conn, p); err != nil {
			a := <-got
			return a.status, a.body, true, a.err
		}
	}
	a := <-got
	return a.status, a.body, false, a.err
}

// splitInParts cuts s into n parts of about equal length.
func splitInParts(s string, n int) []string {
	var out []string
	for i := range n {
		out = append(out, s[i*len(s)/n:(i+1)*len(s)/n])
	}
	return out
}

func slowOrderHead(addr, tok, key string, length int) string {
	return fmt.Sprintf("POST /v1/orders HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nIdempotency-Key: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", addr, tok, key, length)
}

func slowPaymentHead(addr, key string, length int) string {
	return fmt.Sprintf("POST /v1/payment_intents HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer sk_test_local\r\nIdempotency-Key: %s\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: %d\r\n\r\n", addr, key, length)
}

// slowHeaders sends GET path with one header of size bytes and
// returns the status.
func slowHeaders(addr, path string, size int) (int, error) {
	status, _, _, err := slowExchange(addr, fmt.Sprintf("GET %s HTTP/1.1\r\nHost: %s\r\nX-Big: %s\r\nConnection: close\r\n\r\n", path, addr, strings.Repeat("b", size)), nil, 0, -1)
	return status, err
}

// TestSlowClients checks that serve's fixed bounds cut slow and oversized
// clients (header bytes trickled, a body left half sent, a 100 KiB header,
// an oversized sub) without claiming their keys, that a slow legitimate
// request still gets its 201, and that no log shows a key or a body.
// (Named TestHostile2SlowClients before: the second hostile-client test.)
func TestSlowClients(t *testing.T) {
	// Waits on serve's fixed bounds (10s, 30s) most of its time: it runs
	// beside the package's other long waiters (t.Parallel) once the
	// sequential tests are done.
	t.Parallel()
	ordersBin, paymentsBin := binaries(t)
	payAddr, slowPayAddr, ordAddr, slowOrdAddr := freeAddr(t), freeAddr(t), freeAddr(t), freeAddr(t)
	pay := start(t, "http://"+payAddr+"/v1/payment_intents", paymentsBin, "serve", "--addr", payAddr)
	slowPay := start(t, "http://"+slowPayAddr+"/v1/payment_intents", paymentsBin, "serve", "--addr", slowPayAddr, "--latency", "15s")
	ord := start(t, "http://"+ordAddr+"/healthz", ordersBin, "serve", "--addr", ordAddr, "--data-dir", t.TempDir(), "--jwt-secret", testSecret)
	slowOrd := start(t, "http://"+slowOrdAddr+"/healthz", ordersBin, "serve", "--addr", slowOrdAddr, "--data-dir", t.TempDir(), "--jwt-secret", testSecret,
		"--payments-url", "http://"+slowPayAddr)
	// An order service whose gateway address has nothing listening: every
	// charge fails.
	downAddr := freeAddr(t)
	down := start(t, "http://"+downAddr+"/healthz", ordersBin, "serve", "--addr", downAddr, "--data-dir", t.TempDir(), "--jwt-secret", testSecret,
		"--payments-url", "http://"+freeAddr(t))
	tok := token(t, "hostile2-user")

	t.Run("group", func(t *testing.T) {
		for _, tc := range []struct{ name, addr string }{{"orders", ordAddr}, {"payments", payAddr}} {
			t.Run("slowloris/"+tc.name, func(t *testing.T) {
				t.Parallel()
				sent, total, closed := slowloris(tc.addr)
				t.Logf("%s: headers sent one byte a second; the server closed the connection after %d of the last line's %d bytes (closed %v)", tc.name, sent, total, closed)
				if !closed || sent >= total {
					t.Errorf("%s: a slowloris was not cut (%d of %d bytes sent, closed %v)", tc.name, sent, total, closed)
				}
			})
			t.Run("headers/"+tc.name, func(t *testing.T) {
				t.Parallel()
				path := "/healthz"
				if tc.name == "payments" {
					path = "/v1/payment_intents"
				}
				big, err := slowHeaders(tc.addr, path, 100<<10)
				if err != nil {
					t.Fatalf("100 KiB header: %v", err)
				}
				fine, err := slowHeaders(tc.addr, path, 32<<10)
				if err != nil {
					t.Fatalf("32 KiB header: %v", err)
				}
				t.Logf("%s: a 100 KiB header: %d; a 32 KiB header: %d", tc.name, big, fine)
				if big != http.StatusRequestHeaderFieldsTooLarge || fine == http.StatusRequestHeaderFieldsTooLarge || fine == 0 {
					t.Errorf("%s: 100 KiB header %d, want 431; 32 KiB header %d, want an answer other than 431", tc.name, big, fine)
				}
			})
		}

		t.Run("half-body/orders", func(t *testing.T) {
			t.Parallel()
			key := slowKeyMarker + "-half"
			body := slowOrderBody(1)
			status, _, cut, err := slowExchange(ordAddr, slowOrderHead(ordAddr, tok, key, len(body)), splitInParts(body, 2), 0, 1)
			if err != nil {
				t.Fatal(err)
			}
			// The middleware reads the whole body before it claims: the
			// key was never claimed, so the whole request now runs at once.
			again := call(t, "POST", "http://"+ordAddr+"/v1/orders", tok, key, body)
			t.Logf("orders: half a body, then silence: cut %v, answered %d; the same key sent whole afterwards: %d (replayed %q)", cut, status, again.status, again.header.Get("Idempotent-Replayed"))
			if !cut || status == http.StatusCreated {
				t.Errorf("half a body: cut %v, status %d; want the exchange ended by the server without an order", cut, status)
			}
			if again.status != http.StatusCreated || again.header.Get("Idempotent-Replayed") != "" {
				t.Errorf("the key after a cut request: %d %s; want a first 201 (the key was never claimed)", again.status, again.body)
			}
		})
		t.Run("half-body/payments", func(t *testing.T) {
			t.Parallel()
			key := slowKeyMarker + "-half-pay"
			status, _, cut, err := slowExchange(payAddr, slowPaymentHead(payAddr, key, len(slowPaymentForm)), splitInParts(slowPaymentForm, 2), 0, 1)
			if err != nil {
				t.Fatal(err)
			}
			again, body, _, err := slowExchange(payAddr, slowPaymentHead(payAddr, key, len(slowPaymentForm)), []string{slowPaymentForm}, 0, -1)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("payments: half a form, then silence: cut %v, answered %d; the same key sent whole afterwards: %d", cut, status, again)
			if !cut || status == http.StatusOK {
				t.Errorf("half a form: cut %v, status %d; want the exchange ended by the server without a charge", cut, status)
			}
			if again != http.StatusOK || !strings.Contains(body, `"succeeded"`) {
				t.Errorf("the key after a cut request: %d %.300s; want a first 200 succeeded", again, body)
			}
		})

		// A legitimate slow request: its body arrives over 16 s (within the
		// 30 s read bound), then its handler works 15 s more (the gateway's
		// latency), past the 30 s from its first byte. It is answered.
		t.Run("slow-handler/orders", func(t *testing.T) {
			t.Parallel()
			key := slowKeyMarker + "-slow"
			body := slowOrderBody(2)
			began := time.Now()
			status, got, cut, err := slowExchange(slowOrdAddr, slowOrderHead(slowOrdAddr, tok, key, len(body)), splitInParts(body, 17), time.Second, -1)
			t.Logf("orders paying through a gateway with 15s latency, the body sent over 16s: %d after %v (cut %v, %v)", status, time.Since(began).Round(time.Second), cut, err)
			if err != nil || cut || status != http.StatusCreated {
				t.Errorf("a slow but legitimate order: %d %.300s, cut %v, %v; want 201", status, got, cut, err)
			}
		})
		t.Run("slow-handler/payments", func(t *testing.T) {
			t.Parallel()
			began := time.Now()
			status, got, cut, err := slowExchange(slowPayAddr, slowPaymentHead(slowPayAddr, slowKeyMarker+"-slow-pay", len(slowPaymentForm)), splitInParts(slowPaymentForm, 17), time.Second, -1)
			t.Logf("payments with 15s latency, the form sent over 16s: %d after %v (cut %v, %v)", status, time.Since(began).Round(time.Second), cut, err)
			if err != nil || cut || status != http.StatusOK {
				t.Errorf("a slow but legitimate charge: %d %.300s, cut %v, %v; want 200", status, got, cut, err)
			}
		})

		// The failures that log: a charge that cannot reach the gateway
		// (502, logged), then the completer re-driving the key (logged).
		t.Run("logs/gateway-down", func(t *testing.T) {
			t.Parallel()
			a := call(t, "POST", "http://"+downAddr+"/v1/orders", tok, slowKeyMarker+"-down", slowOrderBody(4))
			for i := 0; i < 300 && !strings.Contains(down.logs.String(), "completer re-drove"); i++ {
				time.Sleep(100 * time.Millisecond) // a poll with a deadline (300 tries): ends as soon as the line is logged
			}
			t.Logf("gateway down: %d; the service logged %d lines", a.status, strings.Count(down.logs.String(), "\n"))
			if a.status != http.StatusBadGateway || !strings.Contains(down.logs.String(), "completer re-drove") {
				t.Errorf("gateway down: %d, want 502, then a logged re-drive:\n%s", a.status, down.logs.String())
			}
		})
		t.Run("sub-bound", func(t *testing.T) {
			t.Parallel()
			sign := func(sub string) string {
				s, err := jwt.NewWithClaims(jwt.SigningMethodHS256, jwt.MapClaims{"sub": sub, "exp": time.Now().Add(time.Hour).Unix()}).SignedString([]byte(testSecret))
				if err != nil {
					t.Fatal(err)
				}
				return s
			}
			long := call(t, "POST", "http://"+ordAddr+"/v1/orders", sign(strings.Repeat("u", orders.MaxUser+1)), slowKeyMarker+"-sub", slowOrderBody(3))
			most := call(t, "POST", "http://"+ordAddr+"/v1/orders", sign(strings.Repeat("u", orders.MaxUser)), slowKeyMarker+"-sub", slowOrderBody(3))
			t.Logf("sub of %d bytes: %d; of %d bytes: %d", orders.MaxUser+1, long.status, orders.MaxUser, most.status)
			if long.status != http.StatusUnauthorized || most.status != http.StatusCreated {
				t.Errorf("sub over the bound: %d, want 401; at the bound: %d, want 201", long.status, most.status)
			}
		})
	})

	// Whatever was logged, no key and no body shows whole.
	for name, p := range map[string]*proc{"orders": ord, "orders (slow gateway)": slowOrd, "orders (gateway down)": down, "payments": pay, "payments (latency)": slowPay} {
		logs := p.logs.String()
		if strings.Contains(logs, slowKeyMarker) || strings.Contains(logs, slowBodyMarker) {
			t.Errorf("%s logged a key or a body:\n%s", name, logs)
		}
		t.Logf("%s: %d lines of logs, no key or body in them", name, strings.Count(logs, "\n"))
	}
}
