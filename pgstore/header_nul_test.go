package pgstore_test

// Regression test from the last adversarial review of issue 9: a kept
// header holding NUL made every commit fail on PostgreSQL.

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
)

// TestNULInKeptHeaderCompletes checks that an answer whose kept header
// holds NUL still completes on PostgreSQL (its key is not left to 5xx
// forever).
//
// Review 10b, finding: since responses keep their headers (and trailers),
// pgstore writes them as jsonb, and PostgreSQL's jsonb refuses the escape
// \u0000. A handler that puts a request-derived value into a kept header,
// here ServeMux's path value in Location (POST /items/%00 gives name
// "\x00", which net/http sends as is), cannot complete: Complete fails
// (22P05), the transaction holding the handler's work rolls back, the
// caller gets 503 and every retry, and every re-drive by the completer,
// fails the same way. The same answer completes in memstore and
// sqlitestore. The client's request should get its 201 (or a 4xx), never
// a 5xx that no retry can cure.
func TestNULInKeptHeaderCompletes(t *testing.T) {
	pool := migratedPool(t)
	store := pgstore.New(pool, pgstore.Options{})
	ran := 0
	mux := http.NewServeMux()
	mux.HandleFunc("POST /items/{name}", func(w http.ResponseWriter, r *http.Request) {
		ran++
		w.Header().Set("Location", "/items/"+r.PathValue("name"))
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "made")
	})
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(mux)
	for i := 1; i <= 2; i++ {
		req := httptest.NewRequest(http.MethodPost, "/items/%00", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "k-nul")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		t.Logf("attempt %d: status %d, replayed %q, handler ran %d times, body %.200s",
			i, rec.Code, rec.Header().Get("Idempotent-Replayed"), ran, rec.Body.String())
		if rec.Code >= 500 {
			t.Fatalf("attempt %d: answered %d; a 201 whose Location holds a NUL cannot be stored in jsonb, "+
				"so the operation never completes", i, rec.Code)
		}
	}
}
