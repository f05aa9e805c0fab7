package orders

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
)

// flakyRepo fails the next fail calls of Create with a transient error,
// after which it writes through.
type flakyRepo struct {
	Repository
	fail *atomic.Int32
}

func (r flakyRepo) Create(ctx context.Context, o *Order) error {
	if r.fail.Add(-1) >= 0 {
		return errors.New("transient: serialization failure")
	}
	return r.Repository.Create(ctx, o)
}

// serveFlaky serves b's API again with a repository whose next fail
// Creates fail transiently.
func serveFlaky(t *testing.T, b *testBundle, fail int32) {
	t.Helper()
	n := new(atomic.Int32)
	n.Store(fail)
	srv := httptest.NewServer(NewHandler(Config{
		Repo: flakyRepo{b.repo, n}, Payer: b.payer, Idem: b.store, Secret: b.secret, Now: b.clock.Now,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Metrics: b.metrics,
	}))
	t.Cleanup(srv.Close)
	b.srv = srv
}

// TestRetryAfterGatewayForgotKeyUsesFoundPayment: the first attempt pays
// and its order's write fails (503, nothing stored); the gateway then
// forgets the payment key (its retention passed). The retry, attempt 2,
// finds the first payment by the order's reference and writes the order
// with it: no second charge.
func TestRetryAfterGatewayForgotKeyUsesFoundPayment(t *testing.T) {
	b := setup(t)
	serveFlaky(t, b, 1)
	b.post(t, "alice", "late-1", orderBody).wantProblem(t, http.StatusServiceUnavailable, ProblemUnavailable)
	if got := b.payer.findCount(); got != 0 {
		t.Errorf("the first attempt looked the payment up %d times; want 0 (nothing can be paid before it)", got)
	}
	b.payer.forgetKeys()

	again := b.post(t, "alice", "late-1", orderBody)
	if again.status != http.StatusCreated {
		t.Fatalf("retry: %s, want 201", again)
	}
	o := decodeOrder(t, again.body)
	if o.PaymentID != "pi_1" {
		t.Errorf("order paid by %s, want pi_1 (the first attempt's payment)", o.PaymentID)
	}
	if got, want := b.payer.succeeded(), 1; got != want {
		t.Errorf("payments = %d, want %d", got, want)
	}
	if got, want := b.payer.callCount(), 1; got != want {
		t.Errorf("Pay calls = %d, want %d (the retry found the payment)", got, want)
	}
	if got, want := b.payer.findCount(), 1; got != want {
		t.Errorf("lookups = %d, want %d", got, want)
	}
	if got := b.metrics.PaymentsFound.Load(); got != 1 {
		t.Errorf("found counter = %d, want 1", got)
	}
	if got := b.countOrders(t); got != 1 {
		t.Errorf("orders = %d, want 1", got)
	}
	// The answer is stored as any other: a repeat replays it.
	if r := b.post(t, "alice", "late-1", orderBody); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("repeat: %s, want a replay", r)
	}
	if got := b.payer.findCount(); got != 1 {
		t.Errorf("lookups after the replay = %d, want 1", got)
	}
}

// TestRetryWithoutEarlierPaymentPaysWithSameKey: when the first attempt
// failed before paying, the retry finds nothing and pays with the
// operation's own payment key.
func TestRetryWithoutEarlierPaymentPaysWithSameKey(t *testing.T) {
	b := setup(t)
	b.payer.failBefore = 1
	b.post(t, "alice", "nopay-1", orderBody).wantProblem(t, http.StatusBadGateway, ProblemPaymentGateway)
	if r := b.post(t, "alice", "nopay-1", orderBody); r.status != http.StatusCreated {
		t.Fatalf("retry: %s, want 201", r)
	}
	b.payer.mu.Lock()
	keys := append([]string(nil), b.payer.keys...)
	b.payer.mu.Unlock()
	if len(keys) != 2 || keys[0] != keys[1] {
		t.Errorf("payment keys = %q, want the same key twice", keys)
	}
	if got, want := b.payer.findCount(), 1; got != want {
		t.Errorf("lookups = %d, want %d", got, want)
	}
	if got, want := b.payer.succeeded(), 1; got != want {
		t.Errorf("payments = %d, want %d", got, want)
	}
	if got := b.metrics.PaymentsFound.Load(); got != 0 {
		t.Errorf("found counter = %d, want 0", got)
	}
}

// TestFindPaymentFailureIs502NotStored: a lookup that fails is a gateway
// failure: 502, nothing paid or stored, and the next retry goes on.
func TestFindPaymentFailureIs502NotStored(t *testing.T) {
	b := setup(t)
	serveFlaky(t, b, 1)
	b.post(t, "alice", "f-1", orderBody).wantProblem(t, http.StatusServiceUnavailable, ProblemUnavailable)
	b.payer.forgetKeys()
	b.payer.findFail = 1
	b.post(t, "alice", "f-1", orderBody).wantProblem(t, http.StatusBadGateway, ProblemPaymentGateway)
	if got, want := b.payer.callCount(), 1; got != want {
		t.Errorf("Pay calls = %d, want %d (a failed lookup pays nothing)", got, want)
	}
	r := b.post(t, "alice", "f-1", orderBody)
	if r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("retry after the failed lookup: %s, want a fresh 201", r)
	}
	if o := decodeOrder(t, r.body); o.PaymentID != "pi_1" {
		t.Errorf("order paid by %s, want pi_1", o.PaymentID)
	}
	if got, want := b.payer.succeeded(), 1; got != want {
		t.Errorf("payments = %d, want %d", got, want)
	}
}

// TestFirstAttemptDoesNotLookUp: a key's first attempt pays at once, and
// a request without a key is never looked up.
func TestFirstAttemptDoesNotLookUp(t *testing.T) {
	b := setup(t)
	if r := b.post(t, "alice", "first-1", orderBody); r.status != http.StatusCreated {
		t.Fatalf("%s", r)
	}
	if got := b.payer.findCount(); got != 0 {
		t.Errorf("lookups = %d, want 0", got)
	}
}
