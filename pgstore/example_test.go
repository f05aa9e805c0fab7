package pgstore_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Example shows a service that creates orders idempotently: the order row
// and the stored response commit in one transaction, so a retry with the
// same Idempotency-Key is answered from the store and no second order is
// written.
//
// It needs a PostgreSQL server (DATABASE_URL), so it has no Output section
// and go test only compiles it; TestExampleRunsOnPostgres runs it against
// the tests' server and checks that it prints:
//
//	201 order 1 replayed=""
//	201 order 1 replayed="true"
//	orders: 1
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	// The service's own table (see ApplyMigrations for its migrations).
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, item text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	store := pgstore.New(pool, pgstore.Options{})

	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := pgstore.FromContext(r.Context())
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
	mux.Handle("POST /v1/orders", idem.Middleware(store, idem.Options{})(createOrder))

	// Expired keys go in the background.
	cleanCtx, stopCleaner := context.WithCancel(ctx)
	defer stopCleaner()
	go (&pgstore.Cleaner{Store: store, Interval: 10 * time.Minute}).Run(cleanCtx)

	srv := httptest.NewServer(mux) // a service would http.ListenAndServe
	defer srv.Close()
	for range 2 {
		req, _ := http.NewRequest("POST", srv.URL+"/v1/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", "order-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("%d %s replayed=%q\n", resp.StatusCode, body, resp.Header.Get("Idempotent-Replayed"))
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("orders:", n)
}

// ExampleApplyMigrations applies a service's own migrations, kept beside
// the store's in schema_migrations under their own component name.
func ExampleApplyMigrations() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
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

// TestExampleRunsOnPostgres runs Example on a database of its own and
// checks what it prints, as go test checks an Output section: the example
// cannot have one, since it needs the server.
func TestExampleRunsOnPostgres(t *testing.T) {
	t.Setenv("DATABASE_URL", pgtest.Database(t))
	got := exampleStdout(t, Example)
	want := "201 order 1 replayed=\"\"\n201 order 1 replayed=\"true\"\norders: 1\n"
	if got != want {
		t.Fatalf("Example printed\n%s\nwant\n%s", got, want)
	}
}

// exampleStdout returns what run prints on os.Stdout.
func exampleStdout(t *testing.T, run func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan string)
	go func() {
		b, _ := io.ReadAll(r)
		out <- string(b)
	}()
	stdout := os.Stdout
	os.Stdout = w
	defer func() { os.Stdout = stdout }()
	run()
	w.Close()
	return <-out
}
