package pgstore_test

import (
	"context"
	"log"
	"net/http"
	"testing/fstest"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Example shows a service that creates orders idempotently: the order row
// and the stored response commit in one transaction.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/shop")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	store := pgstore.New(pool, pgstore.Options{})

	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := pgstore.FromContext(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if _, err := tx.Exec(r.Context(), `INSERT INTO orders (id) VALUES (gen_random_uuid())`); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	http.Handle("POST /v1/orders", idem.Middleware(store, idem.Options{})(createOrder))

	// Expired keys go in the background.
	go (&pgstore.Cleaner{Store: store, Interval: 10 * time.Minute}).Run(ctx)

	log.Fatal(http.ListenAndServe("127.0.0.1:8080", nil))
}

// ExampleApplyMigrations applies a service's own migrations, kept beside
// the store's in schema_migrations under their own component name.
func ExampleApplyMigrations() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/shop")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	// With //go:embed migrations/*.sql in a variable migrations embed.FS,
	// pass fs.Sub(migrations, "migrations").
	orderMigrations := fstest.MapFS{
		"0001_orders.sql": {Data: []byte(`CREATE TABLE orders (id uuid PRIMARY KEY)`)},
	}
	if err := pgstore.ApplyMigrations(ctx, pool, "orders", orderMigrations); err != nil {
		log.Fatal(err)
	}
}
