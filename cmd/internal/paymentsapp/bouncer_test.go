package paymentsapp

import (
	"bytes"
	"context"
	"errors"
	neturl "net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
)

// TestRunCLIServeBehindPgBouncer: `payments serve --database-url` naming
// PgBouncer in transaction mode, with the schema in the URL's search_path
// (which PgBouncer refuses as a startup parameter), starts, pays once per
// key and refunds, and its tables and rows land in that schema.
func TestRunCLIServeBehindPgBouncer(t *testing.T) {
	bouncer := pgtest.NewBouncer(t)
	db := pgtest.Database(t)
	u, err := neturl.Parse(db)
	if err != nil {
		t.Fatal(err)
	}
	const schema = "gateway"
	dbURL := bouncer.URL(strings.TrimPrefix(u.Path, "/")) + "?search_path=" + schema

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr syncBuffer
	done := make(chan int, 1)
	go func() {
		done <- runCLI(ctx, []string{"serve", "--addr", "127.0.0.1:0"},
			envOf(map[string]string{"PAYMENTS_API_KEY": "sk_test_cli", "PAYMENTS_DATABASE_URL": dbURL}), new(bytes.Buffer), &stderr)
	}()
	base := listening(t, &stderr, done)
	c := payments.NewClient(payments.ClientConfig{BaseURL: base, APIKey: "sk_test_cli"})
	charge := payments.ChargeRequest{Amount: 1299, Currency: "eur", PaymentMethod: "pm_card_visa", IdempotencyKey: "bouncer-pay"}
	first, err := c.Charge(ctx, charge)
	if err != nil {
		t.Fatalf("charging: %v", err)
	}
	again, err := c.Charge(ctx, charge)
	if err != nil || again.ID != first.ID || !again.Replayed {
		t.Fatalf("charging again with the same key: %+v, %v; want %s replayed", again, err, first.ID)
	}
	refund := payments.RefundRequest{PaymentIntent: first.ID, IdempotencyKey: "bouncer-refund"}
	if _, err := c.Refund(ctx, refund); err != nil {
		t.Fatalf("refunding: %v", err)
	}
	if _, err := c.Refund(ctx, refund); err != nil {
		t.Fatalf("refunding again with the same key: %v", err)
	}
	if _, err := c.Refund(ctx, payments.RefundRequest{PaymentIntent: first.ID, IdempotencyKey: "bouncer-refund-2"}); !errors.Is(err, payments.ErrAlreadyRefunded) {
		t.Errorf("a second refund with another key: %v, want ErrAlreadyRefunded", err)
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
		{`SELECT count(*) FROM pg_tables WHERE tablename IN ('payment_intents', 'refunds', 'idempotency_keys') AND schemaname <> '` + schema + `'`, 0},
		{`SELECT count(*) FROM ` + schema + `.payment_intents`, 1},
		{`SELECT count(*) FROM ` + schema + `.refunds`, 1},
	} {
		var got int
		if err := conn.QueryRow(ctx, q.query).Scan(&got); err != nil || got != q.want {
			t.Errorf("%s: %d, %v; want %d", q.query, got, err, q.want)
		}
	}

	cancel()
	select {
	case code := <-done:
		if code != ExitOK {
			t.Errorf("exit code = %d, want 0; stderr %s", code, stderr.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("serve did not stop")
	}
}
