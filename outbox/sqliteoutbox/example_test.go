package sqliteoutbox_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/outbox/sqliteoutbox"
	"github.com/idem-go/idem/sqlitestore"
)

// Example adds an event in the transaction that writes an order, and a
// relay publishes it once the transaction committed.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "outbox-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	store, err := sqlitestore.Open(ctx, filepath.Join(dir, "shop.db"), sqlitestore.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	db := store.DB()
	table := sqliteoutbox.New(db)
	if err := table.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	// The order and its event commit together.
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO orders (id, total) VALUES ('ord_1', 2598)`); err != nil {
		log.Fatal(err)
	}
	err = table.Add(ctx, tx, outbox.Event{
		ID:          "evt_1",
		Subject:     "orders.created",
		OrderingKey: "user_42",
		Body:        []byte(`{"id":"ord_1","total":2598}`),
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		log.Fatal(err)
	}

	// A publisher to a broker would return once the broker acknowledged.
	publish := outbox.PublishFunc(func(ctx context.Context, e outbox.Event) error {
		fmt.Printf("publish %s to %s: %s\n", e.ID, e.Subject, e.Body)
		return nil
	})
	relay := outbox.NewRelay(table, publish, outbox.RelayOptions{})
	sent, err := relay.RunOnce(ctx)
	if err != nil {
		log.Fatal(err)
	}
	unsent, err := table.Unsent(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("sent", sent, "unsent", unsent)
	// Output:
	// publish evt_1 to orders.created: {"id":"ord_1","total":2598}
	// sent 1 unsent 0
}
