package sqlitestore_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/sqlitestore"
)

// Example keeps keys and orders in one SQLite file: the order's INSERT and
// the stored answer commit in one transaction.
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "sqlitestore-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	store, err := sqlitestore.Open(ctx, filepath.Join(dir, "shop.db"), sqlitestore.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	// A service keeps its own tables beside the store's (see ApplyMigrations).
	if _, err := store.DB().ExecContext(ctx, `CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := sqlitestore.FromContext(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		var id int64
		if err := tx.QueryRowContext(r.Context(), `INSERT INTO orders (item) VALUES ('book') RETURNING id`).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d", id)
	})
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(createOrder)

	for range 2 {
		req := httptest.NewRequest("POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", "order-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Printf("%d %s replayed=%q\n", rec.Code, rec.Body, rec.Header().Get("Idempotent-Replayed"))
	}
	var n int
	if err := store.DB().QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("orders:", n)
	// Output:
	// 201 order 1 replayed=""
	// 201 order 1 replayed="true"
	// orders: 1
}
