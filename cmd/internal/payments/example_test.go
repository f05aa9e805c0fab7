package payments_test

import (
	"context"
	"log"
	"path/filepath"

	"github.com/idem-go/idem/cmd/internal/payments"
)

// An in-process gateway on the order service's PostgreSQL database, in a
// schema of its own.
func ExampleOpenPostgres() {
	ctx := context.Background()
	pool, err := payments.PostgresPool(ctx, "postgres://orders@db/orders", payments.DefaultSchema)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, ledger, err := payments.OpenPostgres(ctx, pool, payments.DefaultSchema)
	if err != nil {
		log.Fatal(err)
	}
	gw := payments.NewServer(payments.Config{APIKey: "sk_test_local", Store: store, Ledger: ledger})
	client := payments.NewClient(payments.ClientConfig{
		BaseURL:    payments.InProcessURL,
		APIKey:     "sk_test_local",
		HTTPClient: payments.InProcess(gw),
	})
	_ = client
}

// A gateway on a SQLite file of its own, beside the order service's.
func ExampleOpenSQLite() {
	ctx := context.Background()
	store, ledger, err := payments.OpenSQLite(ctx, filepath.Join("data", "payments.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	gw := payments.NewServer(payments.Config{Store: store, Ledger: ledger})
	_ = gw
}
