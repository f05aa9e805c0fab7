package pgstore_test

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/pgstore"
)

// params describes a request for (user, key) with a 30s lease; the store
// fills in the default TTL.
func params(user, key, fp string) idemdriver.ClaimParams {
	return idemdriver.ClaimParams{User: user, Key: key, Fingerprint: fp, Method: http.MethodPost, Path: "/v1/orders", Lease: 30 * time.Second}
}

func response(body string) *idemdriver.Response {
	return &idemdriver.Response{Status: http.StatusCreated, Body: []byte(body)}
}

// lease claims p, which must be free.
func lease(t *testing.T, s idem.Store, p idemdriver.ClaimParams) *idemdriver.Lease {
	t.Helper()
	c, err := s.Claim(context.Background(), p)
	if err != nil || c.Lease == nil {
		t.Fatalf("Claim(%s/%s) = %+v, %v; want a lease", p.User, p.Key, c, err)
	}
	return c.Lease
}

// begin opens l's transaction and inserts an effect through it, as a
// handler would.
func begin(t *testing.T, s *pgstore.Store, l *idemdriver.Lease, name string) idem.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if _, err := tx.(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, name); err != nil {
		tx.Rollback(ctx)
		t.Fatalf("writing effect %q: %v", name, err)
	}
	return tx
}

func effects(t *testing.T, b *testBundle, name string) int {
	t.Helper()
	var n int
	if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM effects WHERE name = $1`, name).Scan(&n); err != nil {
		t.Fatalf("counting effects: %v", err)
	}
	return n
}

// TestFencedCompleteCommitsNothing: an attempt whose lease is taken over
// while its transaction is open (a claim never waits for it here, unlike
// in sqlitestore) cannot commit what it wrote.
func TestFencedCompleteCommitsNothing(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	ctx := context.Background()
	p := params("u1", "k1", "fp1")
	p.Lease = time.Second
	slow := lease(t, s, p)
	tx := begin(t, s, slow, "slow")

	b.clock.Advance(2 * time.Second)
	fast := lease(t, s, p) // takes over while slow's transaction is open

	if err := tx.Complete(ctx, response("slow")); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("slow Complete: got %v, want ErrFenced", err)
	}
	if got := effects(t, b, "slow"); got != 0 {
		t.Errorf("fenced attempt's effects = %d, want 0", got)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Errorf("Rollback after Complete: %v", err)
	}
	for name, f := range map[string]func(context.Context, *idemdriver.Lease) error{"Release": s.Release, "Fail": s.Fail} {
		if err := f(ctx, slow); !errors.Is(err, idem.ErrFenced) {
			t.Errorf("slow %s: got %v, want ErrFenced", name, err)
		}
	}
	if err := begin(t, s, fast, "fast").Complete(ctx, response("fast")); err != nil {
		t.Fatalf("fast Complete: %v", err)
	}
	if got := effects(t, b, "fast"); got != 1 {
		t.Errorf("owner's effects = %d, want 1", got)
	}
	c, err := s.Claim(ctx, p)
	if err != nil || c.Response == nil || string(c.Response.Body) != "fast" {
		t.Errorf("replay: got %+v, %v; want the fast response", c, err)
	}
}

// TestClaimDoesNotWaitOnOpenTransaction checks that a handler's open
// transaction, however long, never makes a claim on its key wait.
func TestClaimDoesNotWaitOnOpenTransaction(t *testing.T) {
	t.Parallel()
	s, _ := setup(t)
	ctx := context.Background()
	p := params("u1", "k1", "fp1")
	tx := begin(t, s, lease(t, s, p), "open")
	defer tx.Rollback(ctx)
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := s.Claim(cctx, p); !errors.Is(err, idem.ErrInFlight) {
		t.Errorf("Claim during the handler: got %v, want ErrInFlight at once", err)
	}
	if _, err := s.Claim(cctx, params("u1", "k1", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Errorf("Claim during the handler: got %v, want ErrFingerprintMismatch at once", err)
	}
}

func TestFromContext(t *testing.T) {
	t.Parallel()
	s, b := setup(t)
	if _, err := pgstore.FromContext(context.Background()); !errors.Is(err, idem.ErrNoTx) {
		t.Errorf("FromContext outside a request: got %v, want ErrNoTx", err)
	}
	h := idem.Middleware(s, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := pgstore.FromContext(r.Context())
		if err != nil {
			t.Errorf("FromContext: %v", err)
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if _, err := tx.Exec(r.Context(), `INSERT INTO effects (name) VALUES ('mw')`); err != nil {
			t.Errorf("insert: %v", err)
		}
		w.WriteHeader(http.StatusCreated)
	}))
	for range 2 {
		rec := httptest.NewRecorder()
		r := httptest.NewRequest(http.MethodPost, "/v1/orders", bytes.NewReader([]byte(`{}`)))
		r.Header.Set("Idempotency-Key", "mw-1")
		h.ServeHTTP(rec, r)
		if rec.Code != http.StatusCreated {
			t.Errorf("status = %d, want 201", rec.Code)
		}
	}
	if got := effects(t, b, "mw"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
}
