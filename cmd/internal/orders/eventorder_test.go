package orders

import (
	"context"
	"errors"
	"testing"
	"time"
)

// failingGetter is a database that does not answer.
type failingGetter struct{ err error }

func (g failingGetter) Get(context.Context, string, string) (*Order, error) { return nil, g.err }

// CheckEventOrder accepts the event of an order of the database, and
// refuses with ErrUnknownOrder one whose order does not exist, is
// another user's, or has another total or currency; a database that
// does not answer is its own error, not ErrUnknownOrder.
func TestCheckEventOrder(t *testing.T) {
	repos := map[string]func(t *testing.T) Repository{
		"SQLite":     func(t *testing.T) Repository { r, _ := openRepo(t); return r },
		"PostgreSQL": func(t *testing.T) Repository { r, _ := pgOpenRepo(t); return r },
	}
	for name, open := range repos {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			repo := open(t)
			o := &Order{
				ID: "ord_0123456789abcdef01234567", UserID: "alice", Status: StatusPaid,
				Items: []Item{{SKU: "SKU-1", Quantity: 2, UnitPrice: 1299}}, Total: 2598, Currency: "EUR",
				PaymentID: "pi_1", CreatedAt: time.Now().UTC().Truncate(time.Microsecond),
			}
			if err := repo.Create(ctx, o); err != nil {
				t.Fatal(err)
			}
			body, err := OrderJSON(o)
			if err != nil {
				t.Fatal(err)
			}
			ev, err := DecodeCreated(body)
			if err != nil {
				t.Fatal(err)
			}
			if err := CheckEventOrder(ctx, repo, ev); err != nil {
				t.Errorf("the event of an order of the database: %v", err)
			}
			forged := map[string]func(*Order){
				"no such order":  func(e *Order) { e.ID, e.UserID, e.Total = "ord_ffffffffffffffffffffffff", "mallory", 99999 },
				"another user":   func(e *Order) { e.UserID = "mallory" },
				"another total":  func(e *Order) { e.Total = 99999 },
				"other currency": func(e *Order) { e.Currency = "USD" },
			}
			for what, change := range forged {
				e := ev
				change(&e)
				if err := CheckEventOrder(ctx, repo, e); !errors.Is(err, ErrUnknownOrder) {
					t.Errorf("%s: %v, want ErrUnknownOrder", what, err)
				}
			}
			down := errors.New("connection refused")
			if err := CheckEventOrder(ctx, failingGetter{down}, ev); !errors.Is(err, down) || errors.Is(err, ErrUnknownOrder) {
				t.Errorf("a database that does not answer: %v; want its error, not ErrUnknownOrder", err)
			}
		})
	}
}
