package storetest

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
)

// testHandlerCannotEndTx: a handler that asks to commit or roll back the
// request's transaction itself, through the store's own accessor
// (Harness.HandlerCommit, HandlerRollback) or through the Tx of
// idem.TxFromContext (Complete, Rollback), is refused with an error
// matching idem.ErrTxOwned, before its first write and after it, and
// nothing changes: when it then answers as usual, its writes commit once,
// with the stored answer, and a repeat replays that answer without
// running the handler again.
func testHandlerCannotEndTx(t *testing.T, h Harness) {
	ends := []struct {
		name string
		end  func(ctx context.Context) error
	}{
		{"TxFromContextComplete", func(ctx context.Context) error {
			tx, err := idem.TxFromContext(ctx)
			if err != nil {
				return err
			}
			return tx.Complete(ctx, response(`{"by":"the handler"}`))
		}},
		{"TxFromContextRollback", func(ctx context.Context) error {
			tx, err := idem.TxFromContext(ctx)
			if err != nil {
				return err
			}
			return tx.Rollback(ctx)
		}},
	}
	if h.HandlerCommit != nil {
		ends = append(ends, struct {
			name string
			end  func(ctx context.Context) error
		}{"StoreCommit", h.HandlerCommit})
	}
	if h.HandlerRollback != nil {
		ends = append(ends, struct {
			name string
			end  func(ctx context.Context) error
		}{"StoreRollback", h.HandlerRollback})
	}
	for _, e := range ends {
		t.Run(e.name, func(t *testing.T) {
			t.Parallel()
			handlerCannotEndTx(t, h, e.name, e.end)
		})
	}
}

// handlerCannotEndTx runs testHandlerCannotEndTx's request with a handler
// that calls end before its first write and between its two writes.
func handlerCannotEndTx(t *testing.T, h Harness, name string, end func(ctx context.Context) error) {
	ctx := context.Background()
	s := h.New(t)
	const (
		user = "u1"
		body = `{"id":"1"}`
	)
	key := "k-txowned-" + name
	first, second := "txowned-"+name+"-first", "txowned-"+name+"-second"
	runs := 0
	var endErrs []error
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		ctx := r.Context()
		endErrs = append(endErrs, end(ctx)) // before any write
		tx, err := idem.TxFromContext(ctx)
		if err == nil {
			err = h.Write(ctx, tx, first)
		}
		if err == nil {
			endErrs = append(endErrs, end(ctx)) // after a write
			err = h.Write(ctx, tx, second)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/v1/things/1")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(body))
	})
	mw := idem.Middleware(s, idem.Options{
		Lease:  10 * time.Second,
		TTL:    time.Hour,
		User:   func(*http.Request) string { return user },
		Logger: slog.New(slog.DiscardHandler),
	})(handler)
	send := func() *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/v1/things", strings.NewReader(`{"n":1}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		rr := httptest.NewRecorder()
		mw.ServeHTTP(rr, req)
		return rr
	}

	got := send()
	if len(endErrs) != 2 {
		t.Errorf("the handler ended after %d calls to end the transaction (%v), want 2", len(endErrs), endErrs)
	}
	for i, err := range endErrs {
		if !errors.Is(err, idem.ErrTxOwned) {
			t.Errorf("call %d to end the request's transaction = %v, want an error matching idem.ErrTxOwned", i+1, err)
		}
	}
	if got.Code != http.StatusCreated || got.Body.String() != body || got.Header().Get("Idempotent-Replayed") != "" {
		t.Fatalf("first answer: %d %q, Idempotent-Replayed %q; want 201 %q, not replayed",
			got.Code, got.Body, got.Header().Get("Idempotent-Replayed"), body)
	}
	rec, err := s.Get(ctx, user, key)
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Response == nil || rec.Response.Status != http.StatusCreated || !bytes.Equal(rec.Response.Body, []byte(body)) {
		t.Fatalf("stored response = %+v, want 201 %q", rec.Response, body)
	}

	again := send()
	if again.Code != http.StatusCreated || again.Body.String() != body || again.Header().Get("Idempotent-Replayed") != "true" {
		t.Errorf("repeat: %d %q, Idempotent-Replayed %q; want 201 %q replayed",
			again.Code, again.Body, again.Header().Get("Idempotent-Replayed"), body)
	}
	if runs != 1 {
		t.Errorf("the handler ran %d times, want 1", runs)
	}
	if n1, n2 := count(t, h, s, first), count(t, h, s, second); n1 != 1 || n2 != 1 {
		t.Errorf("committed effects: %d before the handler's second call, %d after it; want 1 and 1", n1, n2)
	}
}
