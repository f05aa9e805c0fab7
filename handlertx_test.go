package idem_test

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

// endCountingStore is a memstore whose transactions count the calls that
// reach their Complete and Rollback.
type endCountingStore struct {
	*memstore.Store
	completes, rollbacks atomic.Int32
}

func (s *endCountingStore) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	tx, err := s.Store.Begin(ctx, l)
	if err != nil {
		return nil, err
	}
	return endCountingTx{Tx: tx, s: s}, nil
}

type endCountingTx struct {
	idem.Tx
	s *endCountingStore
}

func (tx endCountingTx) Complete(ctx context.Context, resp *idemdriver.Response) error {
	tx.s.completes.Add(1)
	return tx.Tx.Complete(ctx, resp)
}

func (tx endCountingTx) Rollback(ctx context.Context) error {
	tx.s.rollbacks.Add(1)
	return tx.Tx.Rollback(ctx)
}

func (tx endCountingTx) Unwrap() idem.Tx { return tx.Tx }

// tryToEnd calls Complete and Rollback on TxFromContext's Tx, as a
// handler that wants to end its transaction itself would, and checks
// that both are refused with ErrTxOwned without reaching the store's
// transaction, and that the store's accessor still finds it.
func tryToEnd(t *testing.T, ctx context.Context, s *endCountingStore) *memstore.Tx {
	t.Helper()
	tx, err := idem.TxFromContext(ctx)
	if err != nil {
		t.Fatalf("TxFromContext: %v", err)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK, Body: []byte("the handler's")}); !errors.Is(err, idem.ErrTxOwned) {
		t.Errorf("Complete from the handler = %v, want ErrTxOwned", err)
	}
	if err := tx.Rollback(ctx); !errors.Is(err, idem.ErrTxOwned) {
		t.Errorf("Rollback from the handler = %v, want ErrTxOwned", err)
	}
	if c, r := s.completes.Load(), s.rollbacks.Load(); c != 0 || r != 0 {
		t.Errorf("the store's transaction saw %d Completes and %d Rollbacks from the handler, want none", c, r)
	}
	mtx, err := memstore.FromContext(ctx)
	if err != nil {
		t.Fatalf("memstore.FromContext after the refusals: %v", err)
	}
	return mtx
}

// TestTxFromContextRefusesToEndTx: the Tx that TxFromContext gives a
// handler, or a Do function, refuses Complete and Rollback (ErrTxOwned);
// the work's writes then commit once, with its answer, which a repeat
// replays.
func TestTxFromContextRefusesToEndTx(t *testing.T) {
	t.Run("Middleware", func(t *testing.T) {
		s := &endCountingStore{Store: memstore.New(memstore.Options{})}
		var effects, runs atomic.Int32
		h := idem.Middleware(s, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			tryToEnd(t, r.Context(), s).OnCommit(func() { effects.Add(1) })
			w.WriteHeader(http.StatusCreated)
			w.Write([]byte("made"))
		}))
		send := func() *httptest.ResponseRecorder {
			req := httptest.NewRequest(http.MethodPost, "/v1/things", strings.NewReader(`{}`))
			req.Header.Set("Idempotency-Key", "k1")
			rr := httptest.NewRecorder()
			h.ServeHTTP(rr, req)
			return rr
		}
		for i, replayed := range []string{"", "true"} {
			rr := send()
			if rr.Code != http.StatusCreated || rr.Body.String() != "made" || rr.Header().Get("Idempotent-Replayed") != replayed {
				t.Errorf("answer %d: %d %q, Idempotent-Replayed %q; want 201 %q, %q",
					i+1, rr.Code, rr.Body, rr.Header().Get("Idempotent-Replayed"), "made", replayed)
			}
		}
		if e, n, c := effects.Load(), runs.Load(), s.completes.Load(); e != 1 || n != 1 || c != 1 {
			t.Errorf("%d effects, %d runs, %d Completes; want 1 each", e, n, c)
		}
	})
	t.Run("Do", func(t *testing.T) {
		s := &endCountingStore{Store: memstore.New(memstore.Options{})}
		var effects, runs atomic.Int32
		fn := func(ctx context.Context, _ []byte) ([]byte, error) {
			runs.Add(1)
			tryToEnd(t, ctx, s).OnCommit(func() { effects.Add(1) })
			return []byte("done"), nil
		}
		p := idem.DoParams{User: "u", Key: "k1", Operation: "test.txowned", Logger: slog.New(slog.DiscardHandler)}
		for i, replayed := range []bool{false, true} {
			res, err := idem.Do(context.Background(), s, p, fn)
			if err != nil || string(res.Output) != "done" || res.Replayed != replayed {
				t.Errorf("Do %d = %+v, %v; want %q, replayed %t", i+1, res, err, "done", replayed)
			}
		}
		if e, n, c := effects.Load(), runs.Load(), s.completes.Load(); e != 1 || n != 1 || c != 1 {
			t.Errorf("%d effects, %d runs, %d Completes; want 1 each", e, n, c)
		}
	})
}
