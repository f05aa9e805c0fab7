package orders

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync"
)

// requireJSON answers 415 to a request whose Content-Type is not
// application/json (parameters allowed; a request without one is read as
// JSON), before the key is claimed. The header a request passes with is
// replaced by its bare media type, so that what the middleware keeps of
// it with the claim (Options.KeptRequestHeaders) is bounded whatever the
// client sent.
func requireJSON(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ct := r.Header.Values("Content-Type")
		if len(ct) == 0 {
			next.ServeHTTP(w, r)
			return
		}
		if len(ct) > 1 || !isJSONMediaType(ct[0]) {
			detail := "POST /v1/orders takes a JSON body: send Content-Type: application/json."
			if len(ct) > 1 {
				detail = "The request has more than one Content-Type header; send one, application/json."
			}
			writeUnsupportedMediaType(w, "application/json", detail)
			return
		}
		r.Header["Content-Type"] = []string{"application/json"}
		next.ServeHTTP(w, r)
	})
}

// writeUnsupportedMediaType answers the API's 415 problem with detail,
// naming in Accept-Post the media types the route takes.
func writeUnsupportedMediaType(w http.ResponseWriter, accept, detail string) {
	w.Header().Set("Accept-Post", accept)
	writeProblem(w, newProblem(ProblemUnsupportedMediaType, http.StatusUnsupportedMediaType, "Unsupported media type", detail))
}

// bareMediaType is the media type of the Content-Type value v, without
// its parameters, in lower case.
func bareMediaType(v string) string {
	mt, _, _ := strings.Cut(v, ";")
	return strings.ToLower(strings.TrimSpace(mt))
}

// isJSONMediaType reports whether the Content-Type value v names
// application/json, in any case, with or without parameters.
func isJSONMediaType(v string) bool {
	return strings.EqualFold(bareMediaType(v), "application/json")
}

// guestSlots counts, per guest user, the orders this instance has let in
// under the cap that have not yet committed or failed.
type guestSlots struct {
	mu       sync.Mutex
	inFlight map[string]int
}

func newGuestSlots() *guestSlots { return &guestSlots{inFlight: make(map[string]int)} }

// take counts one more order of user in flight and returns how many are.
func (g *guestSlots) take(user string) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.inFlight[user]++
	return g.inFlight[user]
}

// give counts one order of user less in flight.
func (g *guestSlots) give(user string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.inFlight[user]--; g.inFlight[user] <= 0 {
		delete(g.inFlight, user)
	}
}

// guestTicket is a guest request's hold on a slot: taken by admitGuest
// inside the middleware, given back by guestGate outside it.
type guestTicket struct {
	user string
	held bool
}

type guestTicketKey struct{}

// guestGate gives a guest request a ticket, and gives back the slot it
// took once the idempotency middleware (which next holds) has committed
// or dropped the order: until then the slot stands for an order that a
// count of the database may not show yet.
func (s *server) guestGate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !guestFromContext(r.Context()) {
			next.ServeHTTP(w, r)
			return
		}
		t := new(guestTicket)
		defer func() {
			if t.held {
				s.guests.give(t.user)
			}
		}()
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), guestTicketKey{}, t)))
	})
}

// admitGuest lets a guest's order in under Config.GuestOrderLimit, taking
// a slot for it, or answers the request and returns false: 403
// ProblemGuestOrderLimit, or 503 when the orders cannot be counted. A
// request that is not a guest's is let in.
//
// The cap is exact within one instance: a slot is taken before the count,
// so of two concurrent orders each sees the other (near the cap, one may
// be refused while the other is still in flight and then fails). Across
// instances it is not: concurrent orders of one guest through N instances
// may make up to N-1 orders over it.
func (s *server) admitGuest(ctx context.Context, w http.ResponseWriter, user string) bool {
	t, ok := ctx.Value(guestTicketKey{}).(*guestTicket)
	if !ok || t.held {
		return true
	}
	limit := s.cfg.GuestOrderLimit
	n := s.guests.take(user)
	t.user, t.held = user, true
	made, more, err := s.cfg.Repo.List(ctx, user, min(limit, MaxListLimit), "")
	count := len(made)
	if more {
		count++
	}
	switch {
	case err != nil:
		s.cfg.Logger.ErrorContext(ctx, "orders: counting a guest's orders", "user", user, "err", err)
		w.Header().Set("Retry-After", "1")
		writeProblem(w, newProblem(ProblemUnavailable, http.StatusServiceUnavailable, "Service unavailable",
			"The guest's orders could not be counted. Nothing was charged or stored; retry with the same Idempotency-Key."))
		return false
	case count+n > limit:
		writeProblem(w, newProblem(ProblemGuestOrderLimit, http.StatusForbidden, "Guest order limit reached",
			"A guest may make "+strconv.Itoa(limit)+" orders, and this guest has made them (or has the last ones in flight). Nothing was charged. "+
				"Sign in with a token from `orders token --user ID`, or as a new guest."))
		return false
	}
	return true
}
