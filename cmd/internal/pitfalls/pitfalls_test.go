package pitfalls

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/redistest"
	"github.com/idem-go/idem/pgstore"
)

// orderBody is one checkout: the same bytes on every click and retry.
const orderBody = `{"items":[{"sku":"SKU-1","quantity":2,"unit_price":1299}],"currency":"EUR"}`

// quiet discards the services' logs: the tests read the databases.
var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// payerMode is how the order service passes its payments on to the
// gateway.
type payerMode int

const (
	// payDerived is this project's: the key orders.PaymentKey derived from
	// the operation, and a look-up of the order's payment before paying
	// again on a later attempt.
	payDerived payerMode = iota
	// payDerivedNoSearch is payDerived with the look-up failing: only the
	// key keeps the gateway from charging twice.
	payDerivedNoSearch
	// payNoKey is the trap: no key is passed on (stripe-go then makes a
	// new one for every call), and nothing is looked up.
	payNoKey
	// payNewKey is the trap too: a new key for every attempt, and nothing
	// looked up.
	payNewKey
)

// gatewayPayer is the order service's orders.Payer on the gateway's
// Stripe-compatible API, as ordersapp's, with the key passed on or not.
type gatewayPayer struct {
	c    *payments.Client
	mode payerMode
}

func (p gatewayPayer) Pay(ctx context.Context, req orders.PaymentRequest) (orders.PaymentResult, error) {
	key := req.IdempotencyKey
	switch p.mode {
	case payNoKey:
		key = ""
	case payNewKey:
		key = client.NewKey()
	}
	ch, err := p.c.Charge(ctx, payments.ChargeRequest{
		Amount:         req.Amount,
		Currency:       strings.ToLower(req.Currency),
		IdempotencyKey: key,
		Metadata:       map[string]string{"order_ref": req.OrderRef},
	})
	switch {
	case errors.Is(err, payments.ErrDeclined):
		return orders.PaymentResult{}, fmt.Errorf("%w: %w", orders.ErrDeclined, err)
	case err != nil:
		return orders.PaymentResult{}, err
	}
	return orders.PaymentResult{ID: ch.ID}, nil
}

func (p gatewayPayer) FindPayment(ctx context.Context, orderRef string) (orders.PaymentResult, bool, error) {
	switch p.mode {
	case payNoKey, payNewKey:
		return orders.PaymentResult{}, false, nil
	case payDerivedNoSearch:
		return orders.PaymentResult{}, false, errors.New("search: gateway unavailable")
	}
	ch, err := p.c.FindByOrderRef(ctx, orderRef)
	if err != nil || ch == nil {
		return orders.PaymentResult{}, false, err
	}
	return orders.PaymentResult{ID: ch.ID}, true, nil
}

func (p gatewayPayer) Refund(ctx context.Context, req orders.RefundRequest) error {
	_, err := p.c.Refund(ctx, payments.RefundRequest{PaymentIntent: req.PaymentID, IdempotencyKey: req.IdempotencyKey})
	if errors.Is(err, payments.ErrAlreadyRefunded) {
		return nil
	}
	return err
}

// gateway is the real payment gateway, two instances on one PostgreSQL
// schema (its keys and its ledger), behind a balancer that can send the
// next charge to the instance configured with FailAfterCharge = 1: that
// charge is committed and its connection dropped without an answer.
type gateway struct {
	pool            *pgxpool.Pool
	healthy, faulty http.RoundTripper
	dropNext        atomic.Bool  // the next charge goes to the faulty instance
	charges         atomic.Int64 // POST /v1/payment_intents received
	// hold, when set before the first charge, holds that charge: it
	// sends on entered, then waits for release to close.
	hold *hold
}

type hold struct {
	entered chan struct{}
	release chan struct{}
}

func newHold() *hold { return &hold{entered: make(chan struct{}, 1), release: make(chan struct{})} }

func newGateway(t *testing.T) *gateway {
	t.Helper()
	pool := pgtest.Pool(t, pgtest.MaxConns(4))
	store, ledger, err := payments.OpenPostgres(context.Background(), pool, "") // in the pool's schema
	if err != nil {
		t.Fatalf("gateway: %v", err)
	}
	instance := func(failAfterCharge float64) http.RoundTripper {
		return payments.InProcess(payments.NewServer(payments.Config{
			Store: store, Ledger: ledger, FailAfterCharge: failAfterCharge, Logger: quiet,
		})).Transport
	}
	return &gateway{pool: pool, healthy: instance(0), faulty: instance(1)}
}

func (g *gateway) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Method == http.MethodPost && r.URL.Path == "/v1/payment_intents" {
		if g.charges.Add(1) == 1 && g.hold != nil {
			g.hold.entered <- struct{}{}
			select {
			case <-g.hold.release:
			case <-r.Context().Done():
				return nil, r.Context().Err()
			}
		}
		if g.dropNext.CompareAndSwap(true, false) {
			return g.faulty.RoundTrip(r)
		}
	}
	return g.healthy.RoundTrip(r)
}

// succeeded returns the order_ref of every succeeded PaymentIntent: one
// entry per charge.
func (g *gateway) succeeded(t *testing.T) []string {
	t.Helper()
	rows, err := g.pool.Query(context.Background(),
		`SELECT metadata->>'order_ref' FROM payment_intents WHERE status = 'succeeded' ORDER BY created_at, id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var refs []string
	for rows.Next() {
		var ref string
		if err := rows.Scan(&ref); err != nil {
			t.Fatal(err)
		}
		refs = append(refs, ref)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return refs
}

// serviceConfig is what a test changes in the order service.
type serviceConfig struct {
	// store wraps or replaces the service's pgstore.Store; nil keeps it.
	store func(pg *pgstore.Store) idem.Store
	// ownWrites makes the repository write orders with statements of its
	// own, outside the idempotency store's transaction (for a store that
	// has none).
	ownWrites bool
	payer     payerMode
	// wrap goes around the service's handler, before the idempotency
	// middleware sees the request.
	wrap func(http.Handler) http.Handler
}

// service is the real order service (orders.NewHandler: bearer tokens, the
// idempotency middleware, the order handler and its PostgreSQL
// repository) on a schema of the test's own, paying through the real
// gateway, served over HTTP.
type service struct {
	pool   *pgxpool.Pool
	gw     *gateway
	srv    *httptest.Server
	secret []byte
}

func newService(t *testing.T, cfg serviceConfig) *service {
	t.Helper()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatalf("pgstore.Migrate: %v", err)
	}
	if err := orders.MigratePostgres(ctx, pool); err != nil {
		t.Fatalf("orders migrations: %v", err)
	}
	gw := newGateway(t)
	pg := pgstore.New(pool, pgstore.Options{})
	var store idem.Store = pg
	if cfg.store != nil {
		store = cfg.store(pg)
	}
	txFrom := pgstore.FromContext
	if cfg.ownWrites {
		txFrom = nil
	}
	s := &service{pool: pool, gw: gw, secret: []byte("pitfalls-secret")}
	pay := gatewayPayer{mode: cfg.payer, c: payments.NewClient(payments.ClientConfig{
		BaseURL: payments.InProcessURL, APIKey: "sk_test_pitfalls",
		HTTPClient: &http.Client{Transport: gw, Timeout: 10 * time.Second},
		// stripe-go's own retries (which reuse one key per call) are
		// bounded; none here, so that a dropped answer reaches the order
		// service as it does once they are spent.
		MaxNetworkRetries: -1,
	})}
	h := orders.NewHandler(orders.Config{
		Repo: orders.NewPostgresRepository(pool, txFrom), Payer: pay, Idem: store,
		Secret: s.secret, Logger: quiet,
	})
	if cfg.wrap != nil {
		h = cfg.wrap(h)
	}
	s.srv = httptest.NewServer(h)
	t.Cleanup(s.srv.Close)
	return s
}

// request returns a checkout of user's, POST /v1/orders with orderBody,
// to be sent to base (the service's URL or a proxy's).
func (s *service) request(t *testing.T, ctx context.Context, base, user string) *http.Request {
	t.Helper()
	tok, err := orders.IssueToken(s.secret, user, time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/orders", strings.NewReader(orderBody))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+tok)
	req.Header.Set("Content-Type", "application/json")
	return req
}

// orderIDs returns the ids of user's orders.
func (s *service) orderIDs(t *testing.T, user string) []string {
	t.Helper()
	rows, err := s.pool.Query(context.Background(), `SELECT id FROM orders WHERE user_id = $1 ORDER BY created_at, id`, user)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return ids
}

// answer is what a client was told.
type answer struct {
	status   int
	body     string
	replayed bool
	err      error
}

// send sends req with hc and reads the answer.
func send(hc *http.Client, req *http.Request) answer {
	resp, err := hc.Do(req)
	if err != nil {
		return answer{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return answer{status: resp.StatusCode, body: string(b), replayed: resp.Header.Get("Idempotent-Replayed") == "true", err: err}
}

// errAnswerLost is the error of an exchange whose answer never arrived.
var errAnswerLost = errors.New("connection reset by peer: the answer was lost")

// loseAnswers delivers every request and throws the answers of the first
// n away, reporting a reset connection: the server did the work, and the
// client cannot know it.
type loseAnswers struct {
	base http.RoundTripper
	n    atomic.Int64
	lost atomic.Int64
}

func newLoseAnswers(base http.RoundTripper, n int64) *loseAnswers {
	l := &loseAnswers{base: base}
	l.n.Store(n)
	return l
}

func (l *loseAnswers) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := l.base.RoundTrip(r)
	if err != nil || l.n.Add(-1) < 0 {
		return resp, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	l.lost.Add(1)
	return nil, errAnswerLost
}

// redisClient returns a client of the tests' Redis (redistest.Client:
// TEST_REDIS_URL, or under CI=true the machine's, which must answer;
// elsewhere without TEST_REDIS_URL the test is skipped). Its keys begin
// with the returned prefix, of the test's own, and are deleted when the
// test ends.
func redisClient(t *testing.T) (*redis.Client, string) {
	t.Helper()
	rdb := redistest.Client(t, "pitfalls")
	return rdb, redistest.Prefix(t, rdb, "pit")
}

// forget deletes every Redis key under prefix, as an eviction or a
// failover to a replica that never got them does, and returns how many
// it deleted.
func forget(t *testing.T, rdb *redis.Client, prefix string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := redistest.Delete(ctx, rdb, prefix)
	if err != nil {
		t.Errorf("deleting %s*: %v", prefix, err)
	}
	return n
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// barrier lets n goroutines go on only once all n have arrived: the
// deterministic interleaving of a race.
type barrier struct {
	mu      sync.Mutex
	waiting int
	open    chan struct{}
}

func newBarrier(n int) *barrier { return &barrier{waiting: n, open: make(chan struct{})} }

// wait reports false when the others did not arrive within 10 s.
func (b *barrier) wait() bool {
	b.mu.Lock()
	b.waiting--
	if b.waiting == 0 {
		close(b.open)
	}
	b.mu.Unlock()
	select {
	case <-b.open:
		return true
	case <-time.After(10 * time.Second):
		return false
	}
}
