package payments

// Regression tests from the eighth adversarial review of issue 8.

import (
	"bufio"
	"context"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/pgtest"
)

// rawExchange sends raw to srvURL's host over TCP and reads one answer.
func rawExchange(t *testing.T, srvURL, raw string) *http.Response {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(srvURL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if err := conn.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write([]byte(raw)); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	return resp
}

// TestGatewayUnreadableBodyIs400 checks that the gateway answers a
// malformed request body 400 invalid_request_error, not 500.
//
// Review 8, finding: the gateway's idempotency ErrorHandler
// (writeIdemError) has no case for idem.ErrBadBody, so a request body the
// client sent malformed (here a chunked body whose chunk size is not hex)
// is answered 500 api_error "An unknown error occurred" instead of 400
// invalid_request_error. A 5xx for a client's mistake.
func TestGatewayUnreadableBodyIs400(t *testing.T) {
	srv, _ := setup(t, Config{})
	raw := "POST /v1/payment_intents HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + testKey + "\r\n" +
		"Idempotency-Key: k-chunk\r\nContent-Type: application/x-www-form-urlencoded\r\nTransfer-Encoding: chunked\r\n\r\n" +
		"zz\r\namount=100\r\n0\r\n\r\n"
	resp := rawExchange(t, srv.URL, raw)
	defer resp.Body.Close()
	if resp.StatusCode >= 500 {
		t.Fatalf("a malformed request body is answered %d (server error), want 400", resp.StatusCode)
	}
}

// TestGatewayInvalidUTF8QueryIs400OnPostgres checks that the gateway
// answers a query string that is not UTF-8 400 on PostgreSQL, not a
// retryable 500.
//
// Review 8, finding (same cause as pgstore's
// TestInvalidUTF8QueryIsNot5xx): on PostgreSQL, a query string that is
// not UTF-8 makes the claim fail (the path column is text), and the gateway
// answers 500 with Stripe-Should-Retry: true, so stripe-go sends the same
// doomed request again.
func TestGatewayInvalidUTF8QueryIs400OnPostgres(t *testing.T) {
	url, schema := pgtest.SchemaName(t)
	pool, err := PostgresPool(context.Background(), url, schema)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	st, ledger, err := OpenPostgres(context.Background(), pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	srv, _ := setup(t, Config{Store: st, Ledger: ledger})
	body := chargeForm(100, "pm_card_visa").Encode()
	raw := "POST /v1/payment_intents?x=\xff HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + testKey + "\r\n" +
		"Idempotency-Key: k-utf8\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n" + body
	resp := rawExchange(t, srv.URL, raw)
	defer resp.Body.Close()
	if resp.StatusCode >= 500 {
		t.Fatalf("a query string that is not UTF-8 is answered %d (Stripe-Should-Retry: %q), want 400",
			resp.StatusCode, resp.Header.Get("Stripe-Should-Retry"))
	}
}
