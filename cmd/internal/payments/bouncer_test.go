package payments

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/internal/pgtest"
)

// TestGatewayBehindPgBouncer: a gateway on PostgreSQL through PgBouncer in
// transaction mode (whose server connections change between
// transactions, and which refuses search_path as a startup parameter),
// in the schema of an order service's in-process gateway: payments are
// made, replayed, listed, searched and refunded, concurrently too, and
// every row lands in that schema.
func TestGatewayBehindPgBouncer(t *testing.T) {
	bouncer := pgtest.NewBouncer(t)
	db := pgtest.Database(t)
	u, err := url.Parse(db)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool, err := PostgresPool(ctx, bouncer.URL(strings.TrimPrefix(u.Path, "/")), DefaultSchema)
	if err != nil {
		t.Fatalf("PostgresPool through PgBouncer: %v", err)
	}
	t.Cleanup(pool.Close)
	st, ledger, err := OpenPostgres(ctx, pool, DefaultSchema)
	if err != nil {
		t.Fatalf("OpenPostgres through PgBouncer: %v", err)
	}
	srv, _ := setup(t, Config{Store: st, Ledger: ledger})

	first := create(t, srv, "bouncer-pay", chargeForm(1299, "pm_card_visa"))
	if first.status != http.StatusOK {
		t.Fatalf("creating a PaymentIntent: %d %s", first.status, first.body)
	}
	replay := create(t, srv, "bouncer-pay", chargeForm(1299, "pm_card_visa"))
	if replay.status != http.StatusOK || replay.header.Get("Idempotent-Replayed") != "true" || string(replay.body) != string(first.body) {
		t.Fatalf("the same key again: %d, Idempotent-Replayed %q, %s; want the first answer replayed: %s",
			replay.status, replay.header.Get("Idempotent-Replayed"), replay.body, first.body)
	}
	pi := decodePI(t, first.body)

	refund := url.Values{"payment_intent": {pi.ID}}.Encode()
	r1 := do(t, srv.Client(), http.MethodPost, srv.URL+"/v1/refunds", testKey, "bouncer-refund", refund)
	if r1.status != http.StatusOK {
		t.Fatalf("refunding %s: %d %s", pi.ID, r1.status, r1.body)
	}
	r2 := do(t, srv.Client(), http.MethodPost, srv.URL+"/v1/refunds", testKey, "bouncer-refund", refund)
	if r2.status != http.StatusOK || r2.header.Get("Idempotent-Replayed") != "true" || string(r2.body) != string(r1.body) {
		t.Fatalf("the refund's key again: %d, Idempotent-Replayed %q, %s; want %s replayed", r2.status, r2.header.Get("Idempotent-Replayed"), r2.body, r1.body)
	}

	// Concurrent payments, each on whichever server connection the
	// bouncer gives its transactions.
	const n = 8
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			res, err := post(srv, testKey, fmt.Sprintf("bouncer-many-%d", i), chargeForm(int64(100+i), "pm_card_visa"))
			if err == nil && res.status != http.StatusOK {
				err = fmt.Errorf("%d %s", res.status, res.body)
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("payment %d: %v", i, err)
		}
	}

	if got, err := ledger.Get(ctx, AccountFor(testKey), pi.ID); err != nil || got.AmountRefunded != 1299 {
		t.Errorf("the ledger's %s after its refund: %+v, %v; want 1299 refunded", pi.ID, got, err)
	}
	c := stripeClient(srv)
	if rs, err := c.Refunds(ctx, pi.ID); err != nil || len(rs) != 1 {
		t.Errorf("refunds of %s: %d, %v; want 1", pi.ID, len(rs), err)
	}
	if ids := searchIDs(t, c, "metadata['order_ref']:'ord_1'"); len(ids) != n+1 {
		t.Errorf("search by order_ref: %d PaymentIntents, want %d", len(ids), n+1)
	}
	all := 0
	for _, err := range c.All(ctx) {
		if err != nil {
			t.Fatalf("listing: %v", err)
		}
		all++
	}
	if all != n+1 {
		t.Errorf("listing: %d PaymentIntents, want %d", all, n+1)
	}

	conn, err := pgx.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	for _, q := range []struct {
		query string
		want  int
	}{
		{`SELECT count(*) FROM pg_tables WHERE tablename IN ('payment_intents', 'refunds', 'idempotency_keys') AND schemaname <> '` + DefaultSchema + `'`, 0},
		{`SELECT count(*) FROM ` + DefaultSchema + `.payment_intents`, n + 1},
		{`SELECT count(*) FROM ` + DefaultSchema + `.refunds`, 1},
		{`SELECT count(*) FROM ` + DefaultSchema + `.idempotency_keys`, n + 2},
	} {
		var got int
		if err := conn.QueryRow(ctx, q.query).Scan(&got); err != nil || got != q.want {
			t.Errorf("%s: %d, %v; want %d", q.query, got, err, q.want)
		}
	}
}
