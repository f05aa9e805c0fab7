package memstore_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

// Example shows memstore's transactions: a handler's effects are
// registered with OnCommit and run only if the outcome commits, so an
// attempt that fails leaves nothing behind and its retry runs again.
func Example() {
	store := memstore.New(memstore.Options{})

	var orders []string
	fail := true // the first attempt fails after its "write"
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := memstore.FromContext(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		tx.OnCommit(func() { orders = append(orders, "book") })
		if fail {
			fail = false
			http.Error(w, "payment provider unreachable", http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))

	for range 3 {
		req := httptest.NewRequest("POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", "order-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Printf("%d replayed=%q orders=%v\n", rec.Code, rec.Header().Get("Idempotent-Replayed"), orders)
	}
	// Output:
	// 502 replayed="" orders=[]
	// 201 replayed="" orders=[book]
	// 201 replayed="true" orders=[book]
}
