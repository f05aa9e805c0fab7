package pitfalls

import (
	"context"
	"net/http"
	"sync"
	"testing"

	"github.com/idem-go/idem/client"
)

// Trap (a): the key is made by the server, or anew for every click, instead
// of once per checkout attempt on the client. A key only deduplicates the
// requests that carry it: one made after the request left the client (by
// the server) or for each click names a new operation on every resend.

// TestKeyPerCheckoutAttempt: a checkout whose first answer is lost and
// that the user submits twice at once makes two orders and two charges
// when the server makes the key or each click makes one, and one order
// and one charge when the client makes one key for the checkout attempt
// and sends it with every click and every retry.
func TestKeyPerCheckoutAttempt(t *testing.T) {
	t.Run("naive/server makes the key", func(t *testing.T) {
		// The service fills in a missing Idempotency-Key itself, as a
		// gateway or middleware that "makes every request idempotent"
		// does. The client resends after its answer was lost.
		s := newService(t, serviceConfig{wrap: func(next http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Header.Get("Idempotency-Key") == "" {
					r.Header.Set("Idempotency-Key", client.NewKey())
				}
				next.ServeHTTP(w, r)
			})
		}})
		lose := newLoseAnswers(s.srv.Client().Transport, 1)
		hc := &http.Client{Transport: lose}
		var a answer
		for range 3 { // the client's resend: at most 3 tries
			if a = send(hc, s.request(t, context.Background(), s.srv.URL, "alice")); a.err == nil {
				break
			}
		}
		if a.status != http.StatusCreated || lose.lost.Load() != 1 {
			t.Fatalf("checkout: %d %v (%d answers lost); want a 201 after one lost answer", a.status, a.err, lose.lost.Load())
		}
		wantCounts(t, s, "alice", 2, 2)
	})

	t.Run("naive/new key per click", func(t *testing.T) {
		// client.Transport retries with one key per request, but the page
		// makes a request (so a key) per click: a double click is two
		// operations.
		s := newService(t, serviceConfig{})
		hc := &http.Client{Transport: &client.Transport{Base: newLoseAnswers(s.srv.Client().Transport, 1)}}
		answers := doubleClick(t, s, hc, context.Background())
		for i, a := range answers {
			if a.status != http.StatusCreated {
				t.Fatalf("click %d: %d %v %s; want 201", i+1, a.status, a.err, a.body)
			}
		}
		if answers[0].body == answers[1].body {
			t.Errorf("both clicks were answered %s; want two orders", answers[0].body)
		}
		wantCounts(t, s, "alice", 2, 2)
	})

	t.Run("one key per checkout attempt", func(t *testing.T) {
		// The page makes the key when the checkout starts and sends it
		// with every click and every retry (client.WithKey).
		s := newService(t, serviceConfig{})
		lose := newLoseAnswers(s.srv.Client().Transport, 1)
		hc := &http.Client{Transport: &client.Transport{Base: lose}}
		attempt := client.WithKey(context.Background(), client.NewKey())
		answers := doubleClick(t, s, hc, attempt)
		for i, a := range answers {
			if a.status != http.StatusCreated {
				t.Fatalf("click %d: %d %v %s; want 201", i+1, a.status, a.err, a.body)
			}
		}
		if answers[0].body != answers[1].body || lose.lost.Load() != 1 {
			t.Errorf("clicks answered %s and %s (%d answers lost); want one order, the same answer twice, after one lost answer",
				answers[0].body, answers[1].body, lose.lost.Load())
		}
		wantCounts(t, s, "alice", 1, 1)
	})
}

// doubleClick submits alice's checkout twice at once with hc and ctx.
func doubleClick(t *testing.T, s *service, hc *http.Client, ctx context.Context) [2]answer {
	t.Helper()
	var (
		answers [2]answer
		wg      sync.WaitGroup
	)
	start := make(chan struct{})
	for i := range answers {
		req := s.request(t, ctx, s.srv.URL, "alice")
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			answers[i] = send(hc, req)
		}()
	}
	close(start)
	wg.Wait()
	return answers
}

// wantCounts checks user's orders and the gateway's succeeded charges.
func wantCounts(t *testing.T, s *service, user string, orders, charges int) {
	t.Helper()
	ids, refs := s.orderIDs(t, user), s.gw.succeeded(t)
	if len(ids) != orders || len(refs) != charges {
		t.Errorf("%d orders %v and %d charges (order_ref %v); want %d and %d", len(ids), ids, len(refs), refs, orders, charges)
	}
}
