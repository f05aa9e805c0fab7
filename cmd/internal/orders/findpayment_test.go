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
	"time"

	"github.com/idem-go/idem/cmd/internal/payments"
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
	serveFlakyRetention(t, b, fail, 0)
}

// serveFlakyRetention is serveFlaky with Config.PaymentKeyRetention set
// to retention (0: the default).
func serveFlakyRetention(t *testing.T, b *testBundle, fail int32, retention time.Duration) {
	t.Helper()
	n := new(atomic.Int32)
	n.Store(fail)
	srv := httptest.NewServer(NewHandler(Config{
		Repo: flakyRepo{b.repo, n}, Payer: b.payer, Idem: b.store, Secret: b.secret, Now: b.clock.Now,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Metrics: b.metrics, PaymentKeyRetention: retention,
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

// oldestYoungAge is the age up to which (excluded) an operation whose
// lookup fails pays with its payment key, with the default retention.
const oldestYoungAge = DefaultPaymentKeyRetention - time.Hour

// TestFindPaymentFailureIs502NotStored: a lookup that fails for an
// operation so old that the gateway may have forgotten its payment key
// (its age at least PaymentKeyRetention less the margin) is a gateway
// failure: 502, nothing paid or stored, and the next retry goes on.
func TestFindPaymentFailureIs502NotStored(t *testing.T) {
	b := setup(t)
	serveFlaky(t, b, 1)
	b.post(t, "alice", "f-1", orderBody).wantProblem(t, http.StatusServiceUnavailable, ProblemUnavailable)
	b.clock.Advance(oldestYoungAge) // the first limit at which the key may be forgotten
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

// TestFindPaymentFailureYoungOperationPaysWithKey: a lookup that fails for
// an operation young enough that the gateway surely remembers its payment
// key pays with that key, which replays the first attempt's payment: 201,
// one payment.
func TestFindPaymentFailureYoungOperationPaysWithKey(t *testing.T) {
	b := setup(t)
	serveFlaky(t, b, 1)
	b.post(t, "alice", "young-1", orderBody).wantProblem(t, http.StatusServiceUnavailable, ProblemUnavailable)
	b.clock.Advance(oldestYoungAge - time.Second)
	b.payer.findFail = 1
	r := b.post(t, "alice", "young-1", orderBody)
	if r.status != http.StatusCreated {
		t.Fatalf("retry with the lookup down: %s, want 201", r)
	}
	if o := decodeOrder(t, r.body); o.PaymentID != "pi_1" {
		t.Errorf("order paid by %s, want pi_1 (the first attempt's payment, replayed by its key)", o.PaymentID)
	}
	b.payer.mu.Lock()
	keys := append([]string(nil), b.payer.keys...)
	b.payer.mu.Unlock()
	if len(keys) != 2 || keys[0] != keys[1] {
		t.Errorf("payment keys = %q, want the same key twice", keys)
	}
	if got, want := b.payer.succeeded(), 1; got != want {
		t.Errorf("payments = %d, want %d", got, want)
	}
	if got, want := b.payer.findCount(), 1; got != want {
		t.Errorf("lookups = %d, want %d", got, want)
	}
	if got := b.metrics.PaymentsFound.Load(); got != 0 {
		t.Errorf("found counter = %d, want 0", got)
	}
	if got := b.countOrders(t); got != 1 {
		t.Errorf("orders = %d, want 1", got)
	}
}

// TestFindPaymentFailureHonoursRetention: Config.PaymentKeyRetention sets
// the age limit: with 2s (margin 1s), a failed lookup pays at 999ms and
// answers 502 at 1s.
func TestFindPaymentFailureHonoursRetention(t *testing.T) {
	if DefaultPaymentKeyRetention != payments.DefaultKeyRetention {
		t.Errorf("DefaultPaymentKeyRetention = %v, want the gateway's %v", DefaultPaymentKeyRetention, payments.DefaultKeyRetention)
	}
	if got := paymentKeyMargin(2 * time.Second); got != time.Second {
		t.Errorf("margin of 2s = %v, want 1s", got)
	}
	if got := paymentKeyMargin(DefaultPaymentKeyRetention); got != time.Hour {
		t.Errorf("margin of %v = %v, want 1h", DefaultPaymentKeyRetention, got)
	}
	b := setup(t)
	serveFlakyRetention(t, b, 2, 2*time.Second)
	b.post(t, "alice", "r-1", orderBody).wantProblem(t, http.StatusServiceUnavailable, ProblemUnavailable)
	b.clock.Advance(999 * time.Millisecond)
	b.payer.findFail = 2
	// Young: pays with the key (a replay), then the write fails again.
	b.post(t, "alice", "r-1", orderBody).wantProblem(t, http.StatusServiceUnavailable, ProblemUnavailable)
	if got, want := b.payer.callCount(), 2; got != want {
		t.Errorf("Pay calls = %d, want %d", got, want)
	}
	b.clock.Advance(time.Millisecond)
	b.payer.forgetKeys()
	b.post(t, "alice", "r-1", orderBody).wantProblem(t, http.StatusBadGateway, ProblemPaymentGateway)
	if got, want := b.payer.callCount(), 2; got != want {
		t.Errorf("Pay calls = %d, want %d (an old operation's failed lookup pays nothing)", got, want)
	}
	if got, want := b.payer.succeeded(), 1; got != want {
		t.Errorf("payments = %d, want %d", got, want)
	}
}

// TestRetryFindsPaymentBeforePaying: a young operation whose lookup
// works reuses the payment it finds; it does not pay again, even though
// its key would replay.
func TestRetryFindsPaymentBeforePaying(t *testing.T) {
	b := setup(t)
	serveFlaky(t, b, 1)
	b.post(t, "alice", "reuse-1", orderBody).wantProblem(t, http.StatusServiceUnavailable, ProblemUnavailable)
	r := b.post(t, "alice", "reuse-1", orderBody)
	if r.status != http.StatusCreated {
		t.Fatalf("retry: %s, want 201", r)
	}
	if o := decodeOrder(t, r.body); o.PaymentID != "pi_1" {
		t.Errorf("order paid by %s, want pi_1", o.PaymentID)
	}
	if got, want := b.payer.callCount(), 1; got != want {
		t.Errorf("Pay calls = %d, want %d (the retry found the payment)", got, want)
	}
	if got := b.metrics.PaymentsFound.Load(); got != 1 {
		t.Errorf("found counter = %d, want 1", got)
	}
}

// TestSearchOutageRetryWithinKeyRetentionGetsOrder (third review of
// issue 8): the search is a separate API from payments (at Stripe:
// eventually consistent, not offered to every account, with incidents of
// its own). When a failed search was always a 502, a payment whose answer
// was lost could never get its order while the search was down, not from
// the client's retries nor from the completer's re-drives, even a minute
// after it was made, when the operation's own payment key (kept by the
// gateway for 24 h) would replay it safely; the completer then gave up and
// the audit reported a payment without its order. A young operation now
// pays with its key when the search fails.
func TestSearchOutageRetryWithinKeyRetentionGetsOrder(t *testing.T) {
	b := setup(t)
	b.payer.failAfter = 1  // the first attempt pays, and its answer is lost
	b.payer.findFail = 100 // the gateway's search is down; payments work
	b.post(t, "alice", "search-down-1", orderBody).wantProblem(t, http.StatusBadGateway, ProblemPaymentGateway)
	var last response
	for range 5 { // the client retries at once, well within the key's retention
		last = b.post(t, "alice", "search-down-1", orderBody)
		if last.status == http.StatusCreated {
			break
		}
	}
	if last.status != http.StatusCreated {
		t.Errorf("5 retries within a minute of the payment, the gateway's payments up and its search down: last %s; "+
			"want 201 with the first payment (its key still dedups): the payment %s is left without its order", last, "pi_1")
	}
	if got := b.payer.succeeded(); got != 1 {
		t.Errorf("payments = %d, want 1", got)
	}
}
