package sqlitestore_test

// Regression tests from the eighth adversarial review of issue 8.

import (
	"context"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/sqlitestore"
)

// TestTxFromContextAfterSettleRefused checks that TxFromContext after the
// middleware settled the request answers an error, rather than begin a
// transaction that holds SQLite's write lock for ever.
//
// Review 8, finding: the request state behind idem.TxFromContext is not
// closed when the middleware settles the request. A handler that answers
// without touching its transaction (here a 400 refusal; a 5xx or a panic
// as well) and whose context is used a moment later (a goroutine it
// started, a deferred write handed r.Context()) gets a brand-new
// transaction from TxFromContext, begun under the lease of a request that
// is over. Nobody ever completes or rolls it back: on SQLite it holds the
// store's write lock for ever, so every later request of every user is
// answered 503 (on PostgreSQL it pins a pooled connection idle in
// transaction). TxFromContext after the settlement should return an error.
func TestTxFromContextAfterSettleRefused(t *testing.T) {
	path := filepath.Join(t.TempDir(), "idem.db")
	s, err := sqlitestore.Open(context.Background(), path, sqlitestore.Options{BusyTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()

	late := make(chan error, 1)
	begun := make(chan struct{})
	settled := make(chan struct{})
	h := idem.Middleware(s, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Idempotency-Key") == "late" {
			ctx := r.Context()
			go func() {
				<-settled // after the middleware settled
				_, err := idem.TxFromContext(ctx)
				late <- err
				close(begun)
			}()
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	post := func(key string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/v1/things", strings.NewReader(`{"a":1}`))
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	rec := post("late")
	close(settled)
	if rec.Code != http.StatusBadRequest {
		t.Fatalf("first request: %d", rec.Code)
	}
	<-begun
	if err := <-late; err == nil {
		t.Errorf("TxFromContext after the request was settled began a new transaction (want an error)")
	}
	// Another user's, another key's request.
	rec = post("unrelated")
	if rec.Code != http.StatusCreated {
		t.Fatalf("an unrelated request after it is answered %d: %s", rec.Code, rec.Body.String())
	}
}
