package everystore_test

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/go-chi/chi/v5"
	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

// Example_middlewareOnChi uses the middleware as chi middleware, on a group
// of routes; the handler reads chi's URL parameters as usual.
func Example_middlewareOnChi() {
	store := memstore.New(memstore.Options{})

	r := chi.NewRouter()
	r.Group(func(r chi.Router) {
		r.Use(idem.Middleware(store, idem.Options{User: idem.SharedKeySpace}))
		r.Post("/v1/orders/{id}/refund", func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "refund of order %s\n", chi.URLParam(r, "id"))
		})
	})
	srv := httptest.NewServer(r)
	defer srv.Close()

	for range 2 {
		req, _ := http.NewRequest("POST", srv.URL+"/v1/orders/7/refund", strings.NewReader(`{"amount":500}`))
		req.Header.Set("Idempotency-Key", "refund-7")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("%d replayed=%q %s", resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), body)
	}
	// Output:
	// 201 replayed="" refund of order 7
	// 201 replayed="true" refund of order 7
}
