package idem_test

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

// Two users who chose the same key name two operations, so their
// downstream calls must not share a key (the old client.ChildKey(parent,
// step) gave them one: the second user replayed the first's payment).
func TestChildKeyNamesTheOperation(t *testing.T) {
	at := time.Date(2030, 1, 1, 0, 0, 0, 123456000, time.UTC)
	base := &idemdriver.Lease{User: "alice", Key: "order-1", CreatedAt: at, Owner: "o1", Attempt: 1}
	want := base.ChildKey("charge")
	if len(want) != 64 {
		t.Fatalf("ChildKey = %q, want 64 hex characters", want)
	}
	if got := (&idemdriver.Lease{User: "alice", Key: "order-1", CreatedAt: at, Owner: "o2", Attempt: 2}).ChildKey("charge"); got != want {
		t.Errorf("another attempt at the operation: %s, want %s", got, want)
	}
	differ := map[string]string{
		"another user":  (&idemdriver.Lease{User: "bob", Key: "order-1", CreatedAt: at}).ChildKey("charge"),
		"another key":   (&idemdriver.Lease{User: "alice", Key: "order-2", CreatedAt: at}).ChildKey("charge"),
		"reused key":    (&idemdriver.Lease{User: "alice", Key: "order-1", CreatedAt: at.Add(time.Microsecond)}).ChildKey("charge"),
		"another step":  base.ChildKey("refund"),
		"shifted field": (&idemdriver.Lease{User: "aliceorder-1", Key: "", CreatedAt: at}).ChildKey("charge"),
	}
	for name, got := range differ {
		if got == want {
			t.Errorf("%s: same child key %s", name, got)
		}
	}
}

// Through the middleware: the handler's ChildKey(ctx) is the same on every
// attempt of one user's operation and differs between users.
func TestChildKeyFromContext(t *testing.T) {
	if _, err := idem.ChildKey(context.Background(), "charge"); !errors.Is(err, idem.ErrNoTx) {
		t.Errorf("outside a claimed request: got %v, want ErrNoTx", err)
	}
	var (
		mu   sync.Mutex
		seen = map[string][]string{}
	)
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		k, err := idem.ChildKey(r.Context(), "charge")
		if err != nil {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		mu.Lock()
		u := r.Header.Get("X-User")
		seen[u] = append(seen[u], k)
		n := len(seen[u])
		mu.Unlock()
		if n == 1 {
			w.WriteHeader(http.StatusBadGateway) // the first attempt fails: the retry runs again
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	for _, u := range []string{"alice", "bob"} {
		for range 2 {
			b.post(t, "order-1", `{}`, "X-User", u)
		}
	}
	a, bo := seen["alice"], seen["bob"]
	if len(a) != 2 || len(bo) != 2 || a[0] != a[1] || bo[0] != bo[1] || a[0] == bo[0] {
		t.Errorf("child keys: alice %v, bob %v; want one per user, the same on each attempt", a, bo)
	}
}
