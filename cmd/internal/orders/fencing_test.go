package orders

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
)

// An attempt whose lease was taken over while it waited on the gateway
// cannot make a second order: the order and the answer of the attempt that
// took over stand alone.
func TestTakenOverAttemptCannotCommit(t *testing.T) {
	b := setup(t, func(o *setupOptions) { o.idem.Lease = 10 * time.Second })
	block := make(chan struct{})
	b.payer.block, b.payer.entered, b.payer.blockOnce = block, make(chan struct{}, 1), true
	entered := b.payer.entered
	slow := b.postAsync(t, "alice", "t-1", orderBody)
	<-entered

	b.clock.Advance(11 * time.Second) // the slow attempt's lease runs out
	fast := b.post(t, "alice", "t-1", orderBody)
	if fast.status != http.StatusCreated {
		t.Fatalf("takeover: %s, want 201", fast)
	}
	close(block)
	late := <-slow
	if late.status == http.StatusCreated {
		t.Errorf("the fenced attempt answered 201 too: %s", late)
	}
	t.Logf("fenced attempt answered %s", late)

	if got := b.countOrders(t); got != 1 {
		t.Errorf("orders = %d, want 1", got)
	}
	if got := b.payer.succeeded(); got != 1 {
		t.Errorf("payments = %d, want 1", got)
	}
	replay := b.post(t, "alice", "t-1", orderBody)
	if replay.header.Get("Idempotent-Replayed") != "true" || string(replay.body) != string(fast.body) {
		t.Errorf("replay = %s, want the takeover's answer %s", replay, fast)
	}
}

// The create handler, run by the idempotency middleware alone as the
// completer does, takes its user from the lease: no bearer token needed.
func TestCreateHandlerTakesUserFromLease(t *testing.T) {
	b := setup(t)
	h := NewCreateHandler(Config{
		Repo: b.repo, Payer: b.payer, Idem: b.store, Secret: b.secret, Now: b.clock.Now,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	mw := idem.Middleware(b.store, idem.Options{User: func(r *http.Request) string { return r.Header.Get("X-User") }})
	srv := httptest.NewServer(mw(h))
	defer srv.Close()
	r, _ := http.NewRequest("POST", srv.URL+"/v1/orders", strings.NewReader(orderBody))
	r.Header.Set("X-User", "dora")
	r.Header.Set("Idempotency-Key", "c-1")
	resp, err := srv.Client().Do(r)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("status = %d (%s)", resp.StatusCode, body)
	}
	o := decodeOrder(t, body)
	rec, err := b.store.Get(context.Background(), "dora", "c-1")
	if err != nil {
		t.Fatal(err)
	}
	if o.UserID != "dora" || o.ID != OrderID("dora", "c-1", rec.CreatedAt) {
		t.Errorf("order = %+v, want dora's, id %s", o, OrderID("dora", "c-1", rec.CreatedAt))
	}
	// Through the API, the same user and key replay it.
	if got := b.post(t, "dora", "c-1", orderBody); got.header.Get("Idempotent-Replayed") != "true" || string(got.body) != string(body) {
		t.Errorf("replay through the API = %s", got)
	}
}

type conflictRepo struct{ Repository }

func (conflictRepo) Create(context.Context, *Order) error { return ErrExists }

func TestOrderConflict(t *testing.T) {
	b := setup(t)
	h := NewHandler(Config{
		Repo: conflictRepo{b.repo}, Payer: b.payer, Idem: b.store, Secret: b.secret, Now: b.clock.Now,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	srv := httptest.NewServer(h)
	defer srv.Close()
	b.srv = srv
	b.post(t, "alice", "x-1", orderBody).wantProblem(t, http.StatusConflict, ProblemOrderConflict)
}

// A payment whose answer was lost (502, nothing stored) gets its order from
// the completer, through NewCreateHandler, without the client retrying; the
// client's later retry replays it.
func TestCompleterFinishesAfterGatewayFailure(t *testing.T) {
	b := setup(t)
	b.payer.failAfter = 1
	b.post(t, "alice", "c-1", orderBody).wantProblem(t, http.StatusBadGateway, ProblemPaymentGateway)
	if got := b.payer.succeeded(); got != 1 {
		t.Fatalf("payments = %d, want 1 (charged before the failure)", got)
	}
	c := idem.NewCompleter(b.store, NewCreateHandler(Config{
		Repo: b.repo, Payer: b.payer, Idem: b.store, Secret: b.secret, Now: b.clock.Now,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}), idem.CompleterOptions{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	st, err := c.RunOnce(context.Background())
	if err != nil || st.Completed != 1 {
		t.Fatalf("RunOnce = %+v, %v; want one completed", st, err)
	}
	if got := b.countOrders(t); got != 1 {
		t.Errorf("orders = %d, want 1", got)
	}
	if got := b.payer.succeeded(); got != 1 {
		t.Errorf("payments = %d, want 1", got)
	}
	retry := b.post(t, "alice", "c-1", orderBody)
	if retry.status != http.StatusCreated || retry.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry = %s, want the completer's 201 replayed", retry)
	}
	if o := decodeOrder(t, retry.body); o.UserID != "alice" || o.PaymentID != "pi_1" {
		t.Errorf("order = %+v", o)
	}
}
