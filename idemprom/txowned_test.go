package idemprom_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/idemprom"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/sqlitestore"
)

// Through the store wrapper, the handler's transaction still refuses to be
// ended: TxFromContext's Complete and Rollback, and those of the inner
// store's accessor (memstore.FromContext's Tx, sqlitestore.HandlerTx)
// return errors matching idem.ErrTxOwned, and the handler's write commits
// once, with its answer, which a repeat replays.
func TestWrappedStoreHandlerCannotEndTx(t *testing.T) {
	wrap := idemprom.NewStoreMetrics().Wrap
	ctx := context.Background()
	t.Run("memstore", func(t *testing.T) {
		var effects atomic.Int32
		txOwnedThrough(t, wrap(memstore.New(memstore.Options{})), func(ctx context.Context) ([]error, error) {
			tx, err := memstore.FromContext(ctx)
			if err != nil {
				return nil, err
			}
			tx.OnCommit(func() { effects.Add(1) })
			return []error{tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK}), tx.Rollback(ctx)}, nil
		}, func() int { return int(effects.Load()) })
	})
	t.Run("sqlitestore", func(t *testing.T) {
		s, err := sqlitestore.Open(ctx, filepath.Join(t.TempDir(), "idem.db"), sqlitestore.Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		if _, err := s.DB().Exec(`CREATE TABLE effects (name TEXT)`); err != nil {
			t.Fatal(err)
		}
		txOwnedThrough(t, wrap(s), func(ctx context.Context) ([]error, error) {
			tx, err := sqlitestore.FromContext(ctx)
			if err != nil {
				return nil, err
			}
			if _, err := tx.ExecContext(ctx, `INSERT INTO effects (name) VALUES ('one')`); err != nil {
				return nil, err
			}
			return []error{tx.Commit(), tx.Rollback()}, nil
		}, func() int {
			var n int
			if err := s.DB().QueryRow(`SELECT count(*) FROM effects`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		})
	})
}

// txOwnedThrough sends a keyed request twice to a handler on store that
// calls work (which writes an effect and tries to end the transaction
// through the store's accessor) and tries TxFromContext's Complete and
// Rollback; every try must be refused, the second answer replayed, and
// count must report one effect.
func txOwnedThrough(t *testing.T, store idem.Store, work func(context.Context) ([]error, error), count func() int) {
	t.Helper()
	var runs atomic.Int32
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		ctx := r.Context()
		ends, err := work(ctx)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		tx, err := idem.TxFromContext(ctx)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		ends = append(ends, tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK}), tx.Rollback(ctx))
		for i, err := range ends {
			if !errors.Is(err, idem.ErrTxOwned) {
				t.Errorf("try %d to end the transaction = %v, want idem.ErrTxOwned", i+1, err)
			}
		}
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte("made"))
	}))
	for i, replayed := range []string{"", "true"} {
		req := httptest.NewRequest(http.MethodPost, "/x", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", "k1")
		rr := httptest.NewRecorder()
		h.ServeHTTP(rr, req)
		if rr.Code != http.StatusCreated || rr.Body.String() != "made" || rr.Header().Get("Idempotent-Replayed") != replayed {
			t.Errorf("answer %d: %d %q, Idempotent-Replayed %q; want 201 %q, %q",
				i+1, rr.Code, rr.Body, rr.Header().Get("Idempotent-Replayed"), "made", replayed)
		}
	}
	if n, e := runs.Load(), count(); n != 1 || e != 1 {
		t.Errorf("%d runs, %d effects; want 1 and 1", n, e)
	}
}
