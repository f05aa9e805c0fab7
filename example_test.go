package idem_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

// ExampleMiddleware is the whole adoption: wrap the handler, write through
// the request's transaction, and a retry with the same Idempotency-Key is
// answered from the store instead of running the handler again.
func ExampleMiddleware() {
	store := memstore.New(memstore.Options{}) // or sqlitestore, pgstore, redisfront

	var orders []string // the service's data, written only when the outcome commits
	runs := 0
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		tx, err := memstore.FromContext(r.Context()) // sqlitestore/pgstore.FromContext give a *sqlitestore.HandlerTx / pgx.Tx
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		body, _ := io.ReadAll(r.Body)
		tx.OnCommit(func() { orders = append(orders, string(body)) })
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d}`, len(orders)+1)
	})
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(createOrder)

	for range 2 {
		req := httptest.NewRequest("POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", "order-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Printf("%d %s replayed=%q\n", rec.Code, rec.Body, rec.Header().Get("Idempotent-Replayed"))
	}
	fmt.Println("handler runs:", runs, "orders:", orders)
	// Output:
	// 201 {"order":1} replayed=""
	// 201 {"order":1} replayed="true"
	// handler runs: 1 orders: [{"item":"book"}]
}

// ExampleMiddleware_serveMux puts the middleware on one route of net/http's
// ServeMux; the route's pattern and path values work as usual.
func ExampleMiddleware_serveMux() {
	store := memstore.New(memstore.Options{})
	idempotent := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})

	mux := http.NewServeMux()
	mux.Handle("POST /v1/orders", idempotent(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "created\n")
	})))
	mux.HandleFunc("GET /v1/orders/{id}", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "order %s\n", r.PathValue("id"))
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()

	send := func(method, path, key string) {
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(`{"item":"book"}`))
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		fmt.Printf("%s %s: %d replayed=%q %s", method, path, resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), body)
	}
	send("POST", "/v1/orders", "order-1")
	send("POST", "/v1/orders", "order-1")
	send("GET", "/v1/orders/1", "") // not wrapped, and safe methods pass through anyway
	// Output:
	// POST /v1/orders: 201 replayed="" created
	// POST /v1/orders: 201 replayed="true" created
	// GET /v1/orders/1: 200 replayed="" order 1
}

// ExampleTxFromContext shows a handler that works with any store: inside a
// claimed request it gets the transaction its writes and the stored answer
// commit in, which the middleware commits or rolls back, never the
// handler; a request let through without a key (Options.OptionalKey) has
// none, and the handler must write on its own.
func ExampleTxFromContext() {
	store := memstore.New(memstore.Options{})
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace, OptionalKey: true})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := idem.TxFromContext(r.Context())
		switch {
		case errors.Is(err, idem.ErrNoTx):
			fmt.Println("no key: no transaction, the handler writes on its own")
		case err != nil:
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		default:
			// Store packages unwrap it for their own API:
			// memstore.FromContext, sqlitestore.FromContext, pgstore.FromContext.
			// The middleware commits it with the answer, or rolls it
			// back: the handler may not.
			err := tx.Rollback(r.Context())
			fmt.Printf("key %s: the handler's Rollback is refused: %t\n", r.Header.Get("Idempotency-Key"), errors.Is(err, idem.ErrTxOwned))
		}
		w.WriteHeader(http.StatusCreated)
	}))

	for _, key := range []string{"order-1", ""} {
		req := httptest.NewRequest("POST", "/v1/orders", strings.NewReader(`{}`))
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	// Output:
	// key order-1: the handler's Rollback is refused: true
	// no key: no transaction, the handler writes on its own
}

// ExampleNewCompleter finishes a request that failed half-way, whose
// client gave up: the key stays bound to the request, without an answer,
// and the completer runs the request that the store kept through the same
// handler. When the client comes back, it gets that answer replayed. A
// service runs the completer in the background (go c.Run(ctx)); here one
// scan (RunOnce) is enough.
func ExampleNewCompleter() {
	store := memstore.New(memstore.Options{})
	opts := idem.Options{User: idem.SharedKeySpace} // the route's options, shared with the completer

	databaseDown := true // the first attempt fails
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if databaseDown {
			http.Error(w, "database unavailable", http.StatusServiceUnavailable)
			return
		}
		body, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "created %s", body)
	})
	h := idem.Middleware(store, opts)(createOrder)
	c := idem.NewCompleter(store, createOrder, idem.CompleterOptions{Middleware: opts})

	send := func() {
		req := httptest.NewRequest("POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", "order-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Printf("client: %d %s replayed=%q\n", rec.Code, strings.TrimSpace(rec.Body.String()), rec.Header().Get("Idempotent-Replayed"))
	}
	send() // the client gives up after this answer

	databaseDown = false
	st, err := c.RunOnce(context.Background())
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("completer: %+v\n", st)

	send() // the client comes back
	// Output:
	// client: 503 database unavailable replayed=""
	// completer: {Scanned:1 Completed:1 Failed:0 GivenUp:0 Skipped:0}
	// client: 201 created {"item":"book"} replayed="true"
}
