package orders

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/sqlitestore"
	"github.com/idem-go/idem/storetest"
)

// newClock returns a settable clock for the store and the handler to share.
func newClock() *storetest.Clock {
	return storetest.NewClock(time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC))
}

// fakePayer is a gateway in memory: one payment per idempotency key.
type fakePayer struct {
	mu          sync.Mutex // guards the fields below
	payments    map[string]fakePayment
	calls       int
	keys        []string                 // idempotency key of every call
	declineOver int64                    // amounts above it are declined; 0: none
	failAfter   int                      // the next failAfter calls record the payment, then fail
	block       chan struct{}            // when set, Pay waits for it to close
	entered     chan struct{}            // when set, Pay sends on it first
	blockOnce   bool                     // only the next call blocks
	refunds     map[string]RefundRequest // by idempotency key
	refundCalls int
	refundFail  int // the next refundFail Refund calls fail without refunding
	failBefore  int // the next failBefore Pay calls fail without paying
	finds       int // FindPayment calls
	findFail    int // the next findFail FindPayment calls fail
	forgotten   int // payments whose key the gateway forgot (see forgetKeys)
}

type fakePayment struct {
	req      PaymentRequest
	id       string
	seq      int // 1 for the first payment made, and so on
	declined bool
}

func newFakePayer() *fakePayer {
	return &fakePayer{payments: make(map[string]fakePayment), refunds: make(map[string]RefundRequest)}
}

// Refund refunds a payment in full once per key, as the gateway does: a
// repeat of the key is success, a second key for one payment is refused.
func (p *fakePayer) Refund(ctx context.Context, req RefundRequest) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refundCalls++
	if p.refundFail > 0 {
		p.refundFail--
		return errors.New("gateway unavailable")
	}
	if prev, ok := p.refunds[req.IdempotencyKey]; ok {
		if prev != req {
			return fmt.Errorf("idempotency_error: refund key %s reused with other parameters", req.IdempotencyKey)
		}
		return nil
	}
	found := false
	for _, pay := range p.payments {
		found = found || (pay.id == req.PaymentID && !pay.declined)
	}
	if !found {
		return fmt.Errorf("resource_missing: no succeeded payment %s", req.PaymentID)
	}
	for _, r := range p.refunds {
		if r.PaymentID == req.PaymentID {
			return fmt.Errorf("charge_already_refunded: %s", req.PaymentID)
		}
	}
	p.refunds[req.IdempotencyKey] = req
	return nil
}

// refunded returns the refunds made, by idempotency key.
func (p *fakePayer) refunded() map[string]RefundRequest {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.refunds)
}

func (p *fakePayer) Pay(ctx context.Context, req PaymentRequest) (PaymentResult, error) {
	p.mu.Lock()
	block, entered := p.block, p.entered
	if p.blockOnce {
		p.block, p.entered = nil, nil
	}
	p.mu.Unlock()
	if entered != nil {
		entered <- struct{}{}
	}
	if block != nil {
		select {
		case <-block:
		case <-ctx.Done():
			return PaymentResult{}, ctx.Err()
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	p.keys = append(p.keys, req.IdempotencyKey)
	if p.failBefore > 0 {
		p.failBefore--
		return PaymentResult{}, errors.New("gateway unavailable, nothing charged")
	}
	pay, ok := p.payments[req.IdempotencyKey]
	if ok && pay.req != req {
		return PaymentResult{}, fmt.Errorf("idempotency_error: key %s reused with other parameters", req.IdempotencyKey)
	}
	if !ok {
		pay = fakePayment{req: req, id: fmt.Sprintf("pi_%d", len(p.payments)+1), seq: len(p.payments) + 1}
		pay.declined = p.declineOver > 0 && req.Amount > p.declineOver
		p.payments[req.IdempotencyKey] = pay
	}
	if p.failAfter > 0 {
		p.failAfter--
		return PaymentResult{}, errors.New("connection reset after the charge")
	}
	if pay.declined {
		return PaymentResult{}, fmt.Errorf("card_declined: %w", ErrDeclined)
	}
	return PaymentResult{ID: pay.id}, nil
}

// FindPayment finds the first succeeded payment whose OrderRef is
// orderRef, whether or not the gateway still remembers its key, as a
// search by metadata does.
func (p *fakePayer) FindPayment(ctx context.Context, orderRef string) (PaymentResult, bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.finds++
	if p.findFail > 0 {
		p.findFail--
		return PaymentResult{}, false, errors.New("search: gateway unavailable")
	}
	var first *fakePayment
	for _, pay := range p.payments {
		if pay.req.OrderRef == orderRef && !pay.declined && (first == nil || pay.seq < first.seq) {
			first = &pay
		}
	}
	if first == nil {
		return PaymentResult{}, false, nil
	}
	return PaymentResult{ID: first.id}, true, nil
}

// forgetKeys makes the gateway forget every idempotency key, as its
// retention does: the payments stay, and a key used again pays anew.
func (p *fakePayer) forgetKeys() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for k, pay := range p.payments {
		delete(p.payments, k)
		p.forgotten++
		p.payments[fmt.Sprintf("forgotten-%d", p.forgotten)] = pay
	}
}

func (p *fakePayer) findCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.finds
}

// succeeded counts the payments made.
func (p *fakePayer) succeeded() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, pay := range p.payments {
		if !pay.declined {
			n++
		}
	}
	return n
}

func (p *fakePayer) callCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}

type testBundle struct {
	srv     *httptest.Server
	store   *sqlitestore.Store
	repo    *SQLiteRepository
	payer   *fakePayer
	clock   *storetest.Clock
	secret  []byte
	metrics *Metrics
	idemM   *idem.Metrics
}

type setupOptions struct {
	idem       idem.Options
	health     func(context.Context) error
	guest      bool // Config.GuestCheckout
	guestLimit int  // Config.GuestOrderLimit
	// Config.UserRateEvery, UserRateBurst and MaxLiveKeys; 0: defaults.
	userRateEvery time.Duration
	userRateBurst int
	maxLiveKeys   int
}

// newBundle returns a bundle with a fake gateway, a clock and metrics, and
// no server yet.
func newBundle() *testBundle {
	return &testBundle{
		payer:   newFakePayer(),
		clock:   newClock(),
		secret:  []byte("test-secret-0123456789"),
		metrics: new(Metrics),
		idemM:   new(idem.Metrics),
	}
}

// serve starts the order API on repo and st, with b's gateway, clock and
// metrics, and opts applied; it stops when t ends.
func (b *testBundle) serve(t testing.TB, repo Repository, st idem.Store, opts ...func(*setupOptions)) {
	t.Helper()
	var so setupOptions
	for _, o := range opts {
		o(&so)
	}
	so.idem.Metrics = b.idemM
	h := NewHandler(Config{
		Repo:        repo,
		Payer:       b.payer,
		Idem:        st,
		IdemOptions: so.idem,
		Secret:      b.secret,
		Now:         b.clock.Now,
		Health:      so.health,
		Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
		Metrics:     b.metrics,

		GuestCheckout:   so.guest,
		GuestOrderLimit: so.guestLimit,
		UserRateEvery:   so.userRateEvery,
		UserRateBurst:   so.userRateBurst,
		MaxLiveKeys:     so.maxLiveKeys,
	})
	// HTTP/1.1 and unencrypted HTTP/2, as serve's server: gRPC clients
	// of orders.v1.OrderService need the second.
	b.srv = httptest.NewUnstartedServer(h)
	b.srv.Config.Protocols = new(http.Protocols)
	b.srv.Config.Protocols.SetHTTP1(true)
	b.srv.Config.Protocols.SetUnencryptedHTTP2(true)
	b.srv.Start()
	t.Cleanup(b.srv.Close)
}

// setup starts the order API on a fresh SQLite database, with sqlitestore
// as the idempotency store and a fake gateway.
func setup(t testing.TB, opts ...func(*setupOptions)) *testBundle {
	t.Helper()
	ctx := context.Background()
	b := newBundle()
	st, err := sqlitestore.Open(ctx, filepath.Join(t.TempDir(), "orders.db"), sqlitestore.Options{Now: b.clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if err := MigrateSQLite(ctx, st.DB()); err != nil {
		t.Fatal(err)
	}
	b.store = st
	b.repo = NewSQLiteRepository(st.DB(), sqlitestore.FromContext)
	b.serve(t, b.repo, st, opts...)
	return b
}

func (b *testBundle) token(t testing.TB, user string) string {
	t.Helper()
	tok, err := IssueToken(b.secret, user, time.Hour, b.clock.Now())
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func (r response) String() string {
	return fmt.Sprintf("%d %s", r.status, r.body)
}

// problem decodes a problem+json answer, failing the test if it is not one.
func (r response) problem(t *testing.T) map[string]any {
	t.Helper()
	if got, want := r.header.Get("Content-Type"), "application/problem+json"; got != want {
		t.Fatalf("Content-Type = %q, want %q (%s)", got, want, r)
	}
	var p map[string]any
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("problem body: %v (%s)", err, r)
	}
	for _, k := range []string{"type", "title", "status"} {
		if _, ok := p[k]; !ok {
			t.Errorf("problem has no %q: %s", k, r.body)
		}
	}
	if got, want := p["status"], float64(r.status); got != want {
		t.Errorf("problem status = %v, want %v", got, want)
	}
	return p
}

// wantProblem checks that r is a problem of type typ with status.
func (r response) wantProblem(t *testing.T, status int, typ string) map[string]any {
	t.Helper()
	if r.status != status {
		t.Fatalf("status = %d, want %d (%s)", r.status, status, r)
	}
	p := r.problem(t)
	if got := p["type"]; got != typ {
		t.Errorf("type = %v, want %s", got, typ)
	}
	return p
}

type req struct {
	method string
	path   string
	token  string // "" for none
	key    string // "" for none
	body   string
	header map[string]string
}

func (b *testBundle) do(t testing.TB, r req) response {
	t.Helper()
	resp, err := b.tryDo(r)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// tryDo is do for goroutines other than the test's: it returns its error
// instead of failing the test.
func (b *testBundle) tryDo(r req) (response, error) {
	var body io.Reader
	if r.body != "" {
		body = strings.NewReader(r.body)
	}
	hr, err := http.NewRequest(r.method, b.srv.URL+r.path, body)
	if err != nil {
		return response{}, err
	}
	if r.body != "" {
		hr.Header.Set("Content-Type", "application/json")
	}
	if r.token != "" {
		hr.Header.Set("Authorization", "Bearer "+r.token)
	}
	if r.key != "" {
		hr.Header.Set("Idempotency-Key", r.key)
	}
	for k, v := range r.header {
		hr.Header.Set(k, v)
	}
	resp, err := b.srv.Client().Do(hr)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	rb, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, err
	}
	return response{status: resp.StatusCode, header: resp.Header, body: rb}, nil
}

// post creates an order as user with key.
func (b *testBundle) post(t *testing.T, user, key, body string) response {
	t.Helper()
	return b.do(t, req{method: "POST", path: "/v1/orders", token: b.token(t, user), key: key, body: body})
}

// postAsync is post in a goroutine of its own: the answer comes on the
// channel returned; a failure to send the request or read the answer is
// reported with t.Error (the answer is then a zero response).
func (b *testBundle) postAsync(t *testing.T, user, key, body string) <-chan response {
	t.Helper()
	r := req{method: "POST", path: "/v1/orders", token: b.token(t, user), key: key, body: body}
	ch := make(chan response, 1)
	go func() {
		resp, err := b.tryDo(r)
		if err != nil {
			t.Errorf("POST /v1/orders with key %s: %v", key, err)
		}
		ch <- resp
	}()
	return ch
}

func (b *testBundle) get(t *testing.T, user, path string) response {
	t.Helper()
	return b.do(t, req{method: "GET", path: path, token: b.token(t, user)})
}

// countOrders counts the rows of the orders table.
func (b *testBundle) countOrders(t *testing.T) int {
	t.Helper()
	var n int
	if err := b.store.DB().QueryRow(`SELECT count(*) FROM orders`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func decodeOrder(t *testing.T, body []byte) Order {
	t.Helper()
	var o Order
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&o); err != nil {
		t.Fatalf("order body: %v (%s)", err, body)
	}
	return o
}

const orderBody = `{"items":[{"sku":"SKU-1","quantity":2,"unit_price":1299}],"currency":"EUR"}`
