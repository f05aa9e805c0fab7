package pgstore_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing/fstest"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Example creates orders idempotently on PostgreSQL: the order row and
// the stored response commit in one transaction, so a retry with the same
// Idempotency-Key is answered from the store and no second order is
// written.
//
// The examples of this package run in go test against a real server (see
// exampleDB): TEST_DATABASE_URL, by default
// postgres://root@127.0.0.1:5432/test. Without it (and outside CI) they
// are skipped, as the other tests that need PostgreSQL are (TestMain).
func Example() {
	ctx := context.Background()
	pool, drop := exampleDB(ctx, "orders") // a service: pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	defer drop()

	if err := pgstore.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	// The service's own table (it would apply it with ApplyMigrations).
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	store := pgstore.New(pool, pgstore.Options{})

	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := pgstore.FromContext(r.Context()) // the request's pgx.Tx
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		var id int64
		if err := tx.QueryRow(r.Context(), `INSERT INTO orders (item) VALUES ('book') RETURNING id`).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d", id)
	})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/orders", idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(createOrder))

	for range 2 {
		req := httptest.NewRequest("POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", "order-1")
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, req)
		fmt.Printf("%d %s replayed=%q\n", rec.Code, rec.Body, rec.Header().Get("Idempotent-Replayed"))
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("orders:", n)
	// Output:
	// 201 order 1 replayed=""
	// 201 order 1 replayed="true"
	// orders: 1
}

// ExampleApplyMigrations applies a service's own migrations, recorded
// beside the store's in schema_migrations under their own component name.
// Each is applied once, however often (and by however many instances at
// once) it is called. It runs against the server as Example does.
func ExampleApplyMigrations() {
	ctx := context.Background()
	pool, drop := exampleDB(ctx, "migrations")
	defer drop()

	// With //go:embed migrations/*.sql in a variable migrations embed.FS,
	// pass fs.Sub(migrations, "migrations").
	orderMigrations := fstest.MapFS{
		"0001_orders.sql":            {Data: []byte(`CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL)`)},
		"0002_orders_created_at.sql": {Data: []byte(`ALTER TABLE orders ADD COLUMN created_at timestamptz NOT NULL DEFAULT now()`)},
	}
	for range 2 { // a second start finds nothing to do
		if err := pgstore.ApplyMigrations(ctx, pool, "orders", orderMigrations); err != nil {
			log.Fatal(err)
		}
	}
	rows, _ := pool.Query(ctx, `SELECT version FROM schema_migrations WHERE component = 'orders' ORDER BY version`)
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("orders migrations applied:", versions)
	// Output:
	// orders migrations applied: [1 2]
}

// exampleDB connects to TEST_DATABASE_URL (by default the local server
// postgres://root@127.0.0.1:5432/test) with a search_path that selects a
// new schema of this run's own, so that the examples neither see nor
// leave anything in the shared database; drop removes the schema and
// closes the pool. The store's tables go in the schema the search_path
// selects, as a service's do.
func exampleDB(ctx context.Context, name string) (pool *pgxpool.Pool, drop func()) {
	url := os.Getenv("TEST_DATABASE_URL")
	if url == "" {
		url = "postgres://root@127.0.0.1:5432/test"
	}
	schema := fmt.Sprintf("pgstore_example_%s_%d", name, os.Getpid())
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		log.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+schema); err != nil {
		log.Fatalf("the pgstore examples need PostgreSQL (TEST_DATABASE_URL): %v", err)
	}
	return pool, func() {
		if _, err := pool.Exec(context.Background(), `DROP SCHEMA `+schema+` CASCADE`); err != nil {
			log.Printf("dropping schema %s: %v", schema, err)
		}
		pool.Close()
	}
}
