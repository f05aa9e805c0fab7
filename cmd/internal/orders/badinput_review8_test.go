package orders

// Regression tests from the eighth adversarial review of issue 8.

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Review 8, finding: on PostgreSQL, POST /v1/orders whose request target
// carries a query string that is not UTF-8 (net/http accepts it; the order
// API ignores the query) is answered 503 "idempotency store unavailable"
// after two seconds of retries: the middleware keeps r.URL.RequestURI()
// in the claim, and pgstore's text column refuses the byte
// (SQLSTATE 22021). Every retry gets the same 503: a 5xx for a client's
// mistake, which a client that follows Retry-After repeats for ever.
func TestReview8InvalidUTF8QueryOnPostgresIs503(t *testing.T) {
	b := pgSetup(t, nil)
	conn, err := net.Dial("tcp", strings.TrimPrefix(b.srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	raw := "POST /v1/orders?ref=\xff HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b.token(t, "alice") + "\r\n" +
		"Idempotency-Key: k-utf8\r\nContent-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(orderBody)) + "\r\n\r\n" + orderBody
	if _, err := conn.Write([]byte(raw)); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	t.Logf("answer: %d %s", resp.StatusCode, body)
	if resp.StatusCode >= 500 {
		t.Fatalf("a request target with a non-UTF-8 query is answered %d, want a 4xx (or the order)", resp.StatusCode)
	}
}
