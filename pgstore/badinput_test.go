package pgstore_test

// Regression tests from the eighth adversarial review of issue 8.

import (
	"bufio"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
)

// TestInvalidUTF8QueryIsNot5xx checks that a request target whose query is
// not UTF-8 is answered as a client error, not 5xx, on PostgreSQL.
//
// Review 8, finding: a request target whose query holds a byte that is not
// UTF-8 (net/http accepts it, and keeps RawQuery as sent) is kept in the
// claim's path column, a PostgreSQL text column, which refuses it: the
// claim fails, is sent again for two seconds, and the client's mistake is
// answered 503 "store unavailable". It should be answered as a client error
// (4xx), or run: never a 5xx.
func TestInvalidUTF8QueryIsNot5xx(t *testing.T) {
	pool := migratedPool(t)
	store := pgstore.New(pool, pgstore.Options{})
	ran := 0
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ran++
		w.WriteHeader(http.StatusCreated)
	}))
	raw := "POST /v1/orders?ref=\xff HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-utf8\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
	req, err := http.ReadRequest(bufio.NewReader(strings.NewReader(raw)))
	if err != nil {
		t.Fatalf("net/http refuses the request itself: %v", err)
	}
	rec := httptest.NewRecorder()
	start := time.Now()
	h.ServeHTTP(rec, req)
	t.Logf("status %d after %v, handler ran %d times, body %s", rec.Code, time.Since(start), ran, rec.Body.String())
	if rec.Code >= 500 {
		t.Fatalf("a request target the client got wrong is answered %d (server error)", rec.Code)
	}
}
