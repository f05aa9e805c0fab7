package orders

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

// refusedBody is an order that the test schemas refuse for good: a CHECK
// constraint (PostgreSQL) or a trigger's RAISE(ABORT) (SQLite) on its sku,
// standing for the refusals that no validation foresees.
const refusedBody = `{"items":[{"sku":"REFUSED","quantity":1,"unit_price":500}],"currency":"EUR"}`

const (
	pgRefuseSKU     = `ALTER TABLE orders ADD CONSTRAINT test_refused_sku CHECK (NOT items @> '[{"sku":"REFUSED"}]')`
	sqliteRefuseSKU = `CREATE TRIGGER test_refused_sku BEFORE INSERT ON orders
		WHEN NEW.items LIKE '%"sku":"REFUSED"%'
		BEGIN SELECT RAISE(ABORT, 'sku REFUSED is refused'); END`
)

// unwritableEnv is the order API on one database, with a schema that
// refuses refusedBody.
type unwritableEnv struct {
	*testBundle
	store  idemdriver.SweepingStore
	repo   Repository // writes in the idempotent request's transaction
	orders func(t *testing.T) int
}

func unwritableEnvs(t *testing.T) map[string]func(t *testing.T) unwritableEnv {
	return map[string]func(t *testing.T) unwritableEnv{
		"SQLite": func(t *testing.T) unwritableEnv {
			b := setup(t)
			if _, err := b.store.DB().Exec(sqliteRefuseSKU); err != nil {
				t.Fatal(err)
			}
			return unwritableEnv{b, b.store, b.repo, b.countOrders}
		},
		"PostgreSQL": func(t *testing.T) unwritableEnv {
			b := pgSetup(t, nil)
			if _, err := b.pool.Exec(context.Background(), pgRefuseSKU); err != nil {
				t.Fatal(err)
			}
			return unwritableEnv{b.testBundle, b.pgStore, b.pgRepo, b.countOrders}
		},
	}
}

// A paid order that the database refuses for good is refunded once, with
// the operation's refund key, and answered with a final 422 that is stored
// and replayed: one payment, one refund, no order, whatever the retries.
func TestUnwritableOrderIsRefunded(t *testing.T) {
	for name, open := range unwritableEnvs(t) {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			first := e.post(t, "alice", "u-1", refusedBody)
			p := first.wantProblem(t, http.StatusUnprocessableEntity, ProblemOrderNotWritable)
			if got, want := p["title"], "Order could not be written"; got != want {
				t.Errorf("title = %v, want %q", got, want)
			}
			if d, _ := p["detail"].(string); !strings.Contains(d, "refunded") || !strings.Contains(d, "final for this Idempotency-Key") {
				t.Errorf("detail = %q, want it to say the payment was refunded and the answer is final", d)
			}
			if got, want := p["payment_id"], "pi_1"; got != want {
				t.Errorf("payment_id = %v, want %q", got, want)
			}
			if got := e.orders(t); got != 0 {
				t.Errorf("orders = %d, want 0", got)
			}
			rec, err := e.store.Get(context.Background(), "alice", "u-1")
			if err != nil {
				t.Fatal(err)
			}
			if rec.Response == nil || rec.Response.Status != http.StatusUnprocessableEntity {
				t.Fatalf("stored response = %+v, want the 422", rec.Response)
			}
			wantRefunds := map[string]RefundRequest{
				RefundKey("alice", "u-1", rec.CreatedAt): {PaymentID: "pi_1", IdempotencyKey: RefundKey("alice", "u-1", rec.CreatedAt)},
			}
			if got := e.payer.refunded(); !equalRefunds(got, wantRefunds) {
				t.Errorf("refunds = %v, want %v", got, wantRefunds)
			}

			e.clock.Advance(time.Second)
			again := e.post(t, "alice", "u-1", refusedBody)
			if again.status != http.StatusUnprocessableEntity || again.header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(again.body, first.body) {
				t.Errorf("retry = %s (Idempotent-Replayed %q), want the 422 replayed", again, again.header.Get("Idempotent-Replayed"))
			}
			if got := e.payer.callCount(); got != 1 {
				t.Errorf("gateway Pay calls = %d, want 1", got)
			}
			if got := e.payer.succeeded(); got != 1 {
				t.Errorf("payments = %d, want 1", got)
			}
			if got := e.payer.refunded(); !equalRefunds(got, wantRefunds) {
				t.Errorf("refunds after the retry = %v, want %v", got, wantRefunds)
			}
			if got := e.metrics.PaymentsRefunded.Load(); got != 1 {
				t.Errorf("refunds counted = %d, want 1", got)
			}

			// The request's transaction is intact after the refusal: a good
			// order on the same database is written as ever.
			if got := e.post(t, "alice", "u-2", orderBody); got.status != http.StatusCreated {
				t.Errorf("a good order after: %s, want 201", got)
			}
			if got := e.orders(t); got != 1 {
				t.Errorf("orders = %d, want 1", got)
			}
		})
	}
}

// A refund that fails (gateway down) is answered 502 and not stored; the
// retry pays with the same key (a replay, no second charge), refunds with
// the same key once, and gets the final 422.
func TestUnwritableOrderRefundFails(t *testing.T) {
	for name, open := range unwritableEnvs(t) {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			e.payer.refundFail = 1
			e.post(t, "alice", "r-1", refusedBody).wantProblem(t, http.StatusBadGateway, ProblemPaymentGateway)
			if got := len(e.payer.refunded()); got != 0 {
				t.Fatalf("refunds = %d, want 0", got)
			}
			rec, err := e.store.Get(context.Background(), "alice", "r-1")
			if err != nil {
				t.Fatal(err)
			}
			if rec.Response != nil {
				t.Fatalf("the 502 was stored: %+v", rec.Response)
			}

			retry := e.post(t, "alice", "r-1", refusedBody)
			retry.wantProblem(t, http.StatusUnprocessableEntity, ProblemOrderNotWritable)
			if retry.header.Get("Idempotent-Replayed") != "" {
				t.Errorf("the retry is a replay; want it run again")
			}
			if got := e.payer.succeeded(); got != 1 {
				t.Errorf("payments = %d, want 1", got)
			}
			refunds := e.payer.refunded()
			if len(refunds) != 1 || refunds[RefundKey("alice", "r-1", rec.CreatedAt)].PaymentID != "pi_1" {
				t.Errorf("refunds = %v, want one of pi_1 with the derived key", refunds)
			}
			if got := e.orders(t); got != 0 {
				t.Errorf("orders = %d, want 0", got)
			}
			replay := e.post(t, "alice", "r-1", refusedBody)
			if replay.status != http.StatusUnprocessableEntity || replay.header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(replay.body, retry.body) {
				t.Errorf("replay = %s, want the 422 replayed", replay)
			}
		})
	}
}

// The completer finishes a refused order whose refund failed, without the
// client: the payment is refunded once and the 422 stored, provided the
// completer stores what the route stores (StoredStatus).
func TestCompleterRefundsUnwritableOrder(t *testing.T) {
	for name, open := range unwritableEnvs(t) {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			e.payer.refundFail = 1
			e.post(t, "alice", "c-1", refusedBody).wantProblem(t, http.StatusBadGateway, ProblemPaymentGateway)
			quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
			c := idem.NewCompleter(e.store, NewCreateHandler(Config{
				Repo: e.repo, Payer: e.payer, Idem: e.store, Secret: e.secret, Now: e.clock.Now, Logger: quiet,
			}), idem.CompleterOptions{Logger: quiet, Middleware: idem.Options{Stored: StoredStatus}})
			// (The completer counts a stored 422 as Skipped, as it does its
			// middleware's mismatch; what matters is the stored outcome.)
			if st, err := c.RunOnce(context.Background()); err != nil || st.Scanned != 1 {
				t.Fatalf("RunOnce = %+v, %v; want the key re-driven", st, err)
			}
			rec, err := e.store.Get(context.Background(), "alice", "c-1")
			if err != nil {
				t.Fatal(err)
			}
			if rec.Response == nil || rec.Response.Status != http.StatusUnprocessableEntity {
				t.Fatalf("stored response = %+v, want the 422", rec.Response)
			}
			if got := len(e.payer.refunded()); got != 1 {
				t.Errorf("refunds = %d, want 1", got)
			}
			if got := e.payer.succeeded(); got != 1 {
				t.Errorf("payments = %d, want 1", got)
			}
			got := e.post(t, "alice", "c-1", refusedBody)
			got.wantProblem(t, http.StatusUnprocessableEntity, ProblemOrderNotWritable)
			if got.header.Get("Idempotent-Replayed") != "true" {
				t.Errorf("retry after the completer: not a replay (%s)", got)
			}
		})
	}
}

func equalRefunds(a, b map[string]RefundRequest) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// Without a key, a refused order is refunded too (with a key of its own)
// and answered 422.
func TestUnwritableOrderWithoutKey(t *testing.T) {
	b := setup(t, func(o *setupOptions) { o.idem.OptionalKey = true })
	if _, err := b.store.DB().Exec(sqliteRefuseSKU); err != nil {
		t.Fatal(err)
	}
	b.post(t, "alice", "", refusedBody).wantProblem(t, http.StatusUnprocessableEntity, ProblemOrderNotWritable)
	if got := len(b.payer.refunded()); got != 1 {
		t.Errorf("refunds = %d, want 1", got)
	}
	if got := b.countOrders(t); got != 0 {
		t.Errorf("orders = %d, want 0", got)
	}
}

// The repositories tell a refusal for good (ErrUnwritable) from an order
// that exists (ErrExists) and from a failure a retry may cure, and leave
// the request's transaction usable after each.
func TestRepositoryUnwritable(t *testing.T) {
	ctx := context.Background()
	order := func(id, sku, payment string) *Order {
		return &Order{ID: id, UserID: "alice", Status: StatusPaid, Items: []Item{{sku, 1, 1}}, Total: 1, Currency: "EUR",
			PaymentID: payment, CreatedAt: time.Now().UTC().Truncate(time.Microsecond)}
	}
	t.Run("PostgreSQL", func(t *testing.T) {
		_, pool := pgOpenRepo(t)
		if _, err := pool.Exec(ctx, pgRefuseSKU); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `CREATE UNIQUE INDEX test_payment_id ON orders (payment_id)`); err != nil {
			t.Fatal(err)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		repo := NewPostgresRepository(pool, func(context.Context) (pgx.Tx, error) { return tx, nil })
		repositoryUnwritableCases(t, repo, order, true)
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("the request's transaction cannot commit after the refusals: %v", err)
		}
		if _, err := repo.Get(ctx, "alice", "ord_ok"); err != nil {
			t.Errorf("the good order was not committed: %v", err)
		}
		// Not a refusal: the table is gone, which a migration may cure.
		if _, err := pool.Exec(ctx, `DROP TABLE orders`); err != nil {
			t.Fatal(err)
		}
		if err := NewPostgresRepository(pool, nil).Create(ctx, order("ord_x", "A", "pi_x")); err == nil || errors.Is(err, ErrUnwritable) || errors.Is(err, ErrExists) {
			t.Errorf("Create without a table = %v, want another error", err)
		}
	})
	t.Run("SQLite", func(t *testing.T) {
		_, db := openRepo(t)
		for _, stmt := range []string{sqliteRefuseSKU, `CREATE UNIQUE INDEX test_payment_id ON orders (payment_id)`} {
			if _, err := db.Exec(stmt); err != nil {
				t.Fatal(err)
			}
		}
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		repo := sqliteRepoWith(db, func(context.Context) (sqliteExecer, error) { return tx, nil })
		repositoryUnwritableCases(t, repo, order, false)
		if err := tx.Commit(); err != nil {
			t.Fatalf("the request's transaction cannot commit after the refusals: %v", err)
		}
		if _, err := repo.Get(ctx, "alice", "ord_ok"); err != nil {
			t.Errorf("the good order was not committed: %v", err)
		}
		if _, err := db.Exec(`DROP TABLE orders`); err != nil {
			t.Fatal(err)
		}
		own := NewSQLiteRepository(db, nil)
		if err := own.Create(ctx, order("ord_x", "A", "pi_x")); err == nil || errors.Is(err, ErrUnwritable) || errors.Is(err, ErrExists) {
			t.Errorf("Create without a table = %v, want another error", err)
		}
	})
}

func repositoryUnwritableCases(t *testing.T, repo Repository, order func(id, sku, payment string) *Order, pg bool) {
	t.Helper()
	ctx := context.Background()
	if err := repo.Create(ctx, order("ord_ok", "A", "pi_ok")); err != nil {
		t.Fatalf("Create: %v", err)
	}
	cases := []struct {
		name string
		o    *Order
		want error
	}{
		{"CHECK or trigger", order("ord_refused", "REFUSED", "pi_1"), ErrUnwritable},
		{"another unique index", order("ord_other", "A", "pi_ok"), ErrUnwritable},
		{"same id", order("ord_ok", "B", "pi_2"), ErrExists},
	}
	if pg {
		// The case of issue 8: jsonb refuses \u0000 (SQLSTATE 22P05).
		cases = append(cases, struct {
			name string
			o    *Order
			want error
		}{"NUL in jsonb", order("ord_nul", "SKU\x00X", "pi_3"), ErrUnwritable})
	}
	for _, c := range cases {
		err := repo.Create(ctx, c.o)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: Create = %v, want %v", c.name, err, c.want)
		}
		if errors.Is(c.want, ErrExists) && errors.Is(err, ErrUnwritable) {
			t.Errorf("%s: Create = %v, both ErrExists and ErrUnwritable", c.name, err)
		}
	}
	// After every refusal the transaction still writes.
	if err := repo.Create(ctx, order("ord_after", "C", "pi_after")); err != nil {
		t.Errorf("Create after the refusals: %v", err)
	}
}

// Issue 8, point 6: on PostgreSQL a sku holding NUL passed validation, was
// paid for, and then jsonb refused the order. It is refused before paying.
func TestPostgresNULRefusedBeforePaying(t *testing.T) {
	b := pgSetup(t, nil)
	for i, body := range []string{
		`{"items":[{"sku":"SKU\u0000X","quantity":1,"unit_price":100}],"currency":"EUR"}`,
		`{"items":[{"sku":"SKU\u0000","quantity":1,"unit_price":100}],"currency":"EUR"}`,
	} {
		got := b.post(t, "alice", "nul-"+strconv.Itoa(i), body)
		p := got.wantProblem(t, http.StatusBadRequest, ProblemInvalidRequest)
		if d, _ := p["detail"].(string); !strings.Contains(d, "control character") {
			t.Errorf("detail = %q, want it to name the control character", d)
		}
	}
	if got := b.payer.callCount(); got != 0 {
		t.Errorf("gateway calls = %d, want 0", got)
	}
	if got := b.countOrders(t); got != 0 {
		t.Errorf("orders = %d, want 0", got)
	}
}
