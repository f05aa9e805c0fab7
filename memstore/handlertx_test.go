package memstore_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

// The Tx that FromContext gives the handler refuses Complete and Rollback
// (idem.ErrTxOwned) and changes nothing: the effects it registered, before
// the refusals and after them, run once, when the middleware commits the
// answer, which a repeat replays. The store's own Tx (Begin's) still
// completes.
func TestFromContextTxCannotEndTx(t *testing.T) {
	s := memstore.New(memstore.Options{})
	var effects, runs int
	h := idem.Middleware(s, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		ctx := r.Context()
		tx, err := memstore.FromContext(ctx)
		if err != nil {
			t.Fatalf("FromContext: %v", err)
		}
		tx.OnCommit(func() { effects++ })
		if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK, Body: []byte("the handler's")}); !errors.Is(err, idem.ErrTxOwned) {
			t.Errorf("the handler's Complete = %v, want idem.ErrTxOwned", err)
		}
		if err := tx.Rollback(ctx); !errors.Is(err, idem.ErrTxOwned) {
			t.Errorf("the handler's Rollback = %v, want idem.ErrTxOwned", err)
		}
		tx.OnCommit(func() { effects++ })
		if effects != 0 {
			t.Errorf("%d effects ran before the middleware committed", effects)
		}
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte("made"))
	}))
	for i, replayed := range []string{"", "true"} {
		req := httptest.NewRequest(http.MethodPost, "/v1/things", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "k1")
		rr := httptest.NewRecorder()
		h.ServeHTTP(rr, req)
		if rr.Code != http.StatusCreated || rr.Body.String() != "made" || rr.Header().Get("Idempotent-Replayed") != replayed {
			t.Errorf("answer %d: %d %q, Idempotent-Replayed %q; want 201 %q, %q",
				i+1, rr.Code, rr.Body, rr.Header().Get("Idempotent-Replayed"), "made", replayed)
		}
	}
	if effects != 2 || runs != 1 {
		t.Errorf("%d effects, %d runs; want the two effects of one run", effects, runs)
	}

	// Begin's Tx is the middleware's: it completes.
	ctx := context.Background()
	c, err := s.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: "k2", Fingerprint: "fp"})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := s.Begin(ctx, c.Lease)
	if err != nil {
		t.Fatal(err)
	}
	tx.(*memstore.Tx).OnCommit(func() { effects++ })
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusCreated}); err != nil || effects != 3 {
		t.Errorf("Begin's Complete = %v, %d effects; want nil, 3", err, effects)
	}
}
