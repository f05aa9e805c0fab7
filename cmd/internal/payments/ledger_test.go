package payments

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

func newPI(account string, n int) *PaymentIntent {
	return &PaymentIntent{
		ID:       fmt.Sprintf("pi_%s_%03d", account, n),
		Object:   "payment_intent",
		Amount:   int64(n + 1),
		Currency: "eur",
		Status:   StatusSucceeded,
		Metadata: map[string]string{"n": fmt.Sprint(n)},
		Account:  account,
	}
}

// TestLedgerCommitsWithOutcome drives each ledger's Create through the
// idempotency middleware on the store it commits with: a PaymentIntent
// exists only if the outcome commits.
func TestLedgerCommitsWithOutcome(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		for _, tc := range []struct {
			name   string
			key    string
			status int
			want   int
		}{
			{"committed 200", "k", http.StatusOK, 1},
			{"committed 402", "k", http.StatusPaymentRequired, 1},
			{"refused 400", "k", http.StatusBadRequest, 0},
			{"failed 500", "k", http.StatusInternalServerError, 0},
			{"no key: written at once", "", http.StatusInternalServerError, 1},
		} {
			t.Run(tc.name, func(t *testing.T) {
				db := be.open(t, nil)
				h := idem.Middleware(db.store, idem.Options{User: idem.SharedKeySpace, OptionalKey: true})(
					http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						if err := db.ledger.Create(r.Context(), newPI("a", 1)); err != nil {
							t.Errorf("Create: %v", err)
						}
						if got := db.count(t); got != 0 && tc.key != "" {
							t.Errorf("PaymentIntent visible before the commit")
						}
						w.WriteHeader(tc.status)
					}))
				req := httptest.NewRequest(http.MethodPost, "/v1/payment_intents", strings.NewReader("amount=1"))
				if tc.key != "" {
					req.Header.Set("Idempotency-Key", tc.key)
				}
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req)
				if rec.Code != tc.status {
					t.Fatalf("status = %d, want %d", rec.Code, tc.status)
				}
				if got := db.count(t); got != tc.want {
					t.Errorf("ledger holds %d, want %d", got, tc.want)
				}
			})
		}
	})
}

// foreignStore hands out transactions that are no store's of this module.
type foreignStore struct{ idem.Store }

type foreignTx struct{}

func (foreignTx) Complete(context.Context, *idemdriver.Response) error { return nil }
func (foreignTx) Rollback(context.Context) error                       { return nil }

func (foreignStore) Begin(context.Context, *idemdriver.Lease) (idem.Tx, error) {
	return foreignTx{}, nil
}

// TestLedgerRefusesForeignTx: a ledger refuses to write in another
// store's transaction, whose commit would not include it.
func TestLedgerRefusesForeignTx(t *testing.T) {
	forEachBackend(t, func(t *testing.T, ledgerBE testBackend) {
		stores := []struct {
			name string
			open func(t *testing.T) idem.Store
		}{
			{"foreign", func(*testing.T) idem.Store { return foreignStore{memstore.New(memstore.Options{})} }},
		}
		for _, other := range backends {
			if other.name != ledgerBE.name {
				stores = append(stores, struct {
					name string
					open func(t *testing.T) idem.Store
				}{other.name, func(t *testing.T) idem.Store { return other.open(t, nil).store }})
			}
		}
		for _, s := range stores {
			t.Run("in a "+s.name+" tx", func(t *testing.T) {
				db := ledgerBE.open(t, nil)
				var got error
				h := idem.Middleware(s.open(t), idem.Options{User: idem.SharedKeySpace})(
					http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						got = db.ledger.Create(r.Context(), newPI("a", 1))
					}))
				req := httptest.NewRequest(http.MethodPost, "/", strings.NewReader("x"))
				req.Header.Set("Idempotency-Key", "k")
				h.ServeHTTP(httptest.NewRecorder(), req)
				if !errors.Is(got, ErrForeignTx) {
					t.Errorf("Create = %v, want ErrForeignTx", got)
				}
				if n := db.count(t); n != 0 {
					t.Errorf("ledger holds %d, want 0", n)
				}
			})
		}
	})
}

func TestLedgerList(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		ctx := context.Background()
		l := be.open(t, nil).ledger
		for i := range 25 {
			if err := l.Create(ctx, newPI("a", i)); err != nil {
				t.Fatal(err)
			}
			if i%5 == 0 {
				if err := l.Create(ctx, newPI("b", i)); err != nil {
					t.Fatal(err)
				}
			}
		}
		if err := l.Create(ctx, newPI("a", 3)); err == nil {
			t.Error("Create of a duplicate id = nil, want an error")
		}

		p, err := l.List(ctx, ListQuery{Account: "a", Limit: 10})
		if err != nil {
			t.Fatal(err)
		}
		if got, want := idsOf(p.Data), idRange("a", 24, 15); !slices.Equal(got, want) || !p.HasMore {
			t.Errorf("first page = %v has_more %v, want %v has_more", got, p.HasMore, want)
		}
		p, err = l.List(ctx, ListQuery{Account: "a", Limit: 10, StartingAfter: "pi_a_005"})
		if err != nil {
			t.Fatal(err)
		}
		if got, want := idsOf(p.Data), idRange("a", 4, 0); !slices.Equal(got, want) || p.HasMore {
			t.Errorf("last page = %v has_more %v, want %v", got, p.HasMore, want)
		}
		p, err = l.List(ctx, ListQuery{Account: "a", Limit: 5, StartingAfter: "pi_a_010"})
		if err != nil {
			t.Fatal(err)
		}
		if got, want := idsOf(p.Data), idRange("a", 9, 5); !slices.Equal(got, want) || !p.HasMore {
			t.Errorf("middle page = %v has_more %v, want %v has_more", got, p.HasMore, want)
		}
		p, err = l.List(ctx, ListQuery{Account: "a", Limit: 2, EndingBefore: "pi_a_020"})
		if err != nil {
			t.Fatal(err)
		}
		if got, want := idsOf(p.Data), idRange("a", 22, 21); !slices.Equal(got, want) || !p.HasMore {
			t.Errorf("ending_before page = %v has_more %v, want %v has_more", got, p.HasMore, want)
		}
		p, err = l.List(ctx, ListQuery{Account: "a", Limit: 10, EndingBefore: "pi_a_020"})
		if err != nil {
			t.Fatal(err)
		}
		if got, want := idsOf(p.Data), idRange("a", 24, 21); !slices.Equal(got, want) || p.HasMore {
			t.Errorf("ending_before to the newest = %v has_more %v, want %v", got, p.HasMore, want)
		}
		p, err = l.List(ctx, ListQuery{Account: "nobody"})
		if err != nil || len(p.Data) != 0 || p.HasMore {
			t.Errorf("List of an empty account = %v has_more %v, %v", idsOf(p.Data), p.HasMore, err)
		}
		for _, q := range []ListQuery{
			{Account: "a", StartingAfter: "pi_nope"},
			{Account: "a", StartingAfter: "pi_b_000"}, // another account's cursor
			{Account: "a", EndingBefore: "pi_nope"},
			{Account: "a", EndingBefore: "pi_b_000"},
		} {
			if _, err := l.List(ctx, q); !errors.Is(err, ErrNotFound) {
				t.Errorf("List(%+v) = %v, want ErrNotFound", q, err)
			}
		}

		all, err := ListAll(ctx, l, "a")
		if err != nil {
			t.Fatal(err)
		}
		if got, want := idsOf(all), idRange("a", 24, 0); !slices.Equal(got, want) {
			t.Errorf("ListAll = %v, want %v", got, want)
		}
		if got, err := l.Get(ctx, "b", "pi_b_010"); err != nil || got.Metadata["n"] != "10" {
			t.Errorf("Get = %+v, %v", got, err)
		}
		if _, err := l.Get(ctx, "a", "pi_b_010"); !errors.Is(err, ErrNotFound) {
			t.Errorf("Get of another account's = %v, want ErrNotFound", err)
		}
		if _, err := l.Get(ctx, "a", "pi_nope"); !errors.Is(err, ErrNotFound) {
			t.Errorf("Get of a missing one = %v, want ErrNotFound", err)
		}
		// Callers get copies.
		got, _ := l.Get(ctx, "b", "pi_b_010")
		got.Metadata["n"] = "changed"
		if again, _ := l.Get(ctx, "b", "pi_b_010"); again.Metadata["n"] != "10" {
			t.Error("Get returned the ledger's own map")
		}
	})
}

// TestLedgerRoundTrip: what a ledger gives back is what it was given, field
// for field, as the API encodes it.
func TestLedgerRoundTrip(t *testing.T) {
	desc := "two books, 📚 \"quoted\""
	full := &PaymentIntent{
		ID:                 "pi_full",
		Object:             "payment_intent",
		Amount:             2598,
		AmountCapturable:   7,
		AmountReceived:     0,
		CaptureMethod:      "automatic",
		ConfirmationMethod: "automatic",
		Created:            1_900_000_000,
		Currency:           "eur",
		Description:        &desc,
		LastPaymentError: &PaymentError{
			Type: "card_error", Code: "card_declined", DeclineCode: "generic_decline",
			Message: "Your card was declined.", DocURL: "https://stripe.com/docs/error-codes/card-declined",
		},
		Livemode:           true,
		Metadata:           map[string]string{"order_ref": "ord_1", "ünïcode": "✓ <&> \\u0000", "empty-ish": " "},
		PaymentMethod:      "pm_card_chargeDeclined",
		PaymentMethodTypes: []string{"card", "link"},
		Status:             StatusRequiresPaymentMethod,
		Account:            "acct_x",
	}
	bare := &PaymentIntent{ID: "pi_bare", Object: "payment_intent", Amount: 1, Currency: "usd", Status: StatusSucceeded, Account: "acct_x"}
	forEachBackend(t, func(t *testing.T, be testBackend) {
		ctx := context.Background()
		l := be.open(t, nil).ledger
		for _, pi := range []*PaymentIntent{full, bare} {
			if err := l.Create(ctx, pi); err != nil {
				t.Fatal(err)
			}
			got, err := l.Get(ctx, pi.Account, pi.ID)
			if err != nil {
				t.Fatal(err)
			}
			want := pi.Clone()
			if be.name != "memory" {
				// Absent metadata and types read back empty, as Stripe
				// shows them.
				if want.Metadata == nil {
					want.Metadata = map[string]string{}
				}
				if want.PaymentMethodTypes == nil {
					want.PaymentMethodTypes = []string{}
				}
			}
			gj, _ := json.Marshal(got)
			wj, _ := json.Marshal(want)
			if string(gj) != string(wj) || got.Account != want.Account {
				t.Errorf("Get(%s) =\n%s %s\nwant\n%s %s", pi.ID, gj, got.Account, wj, want.Account)
			}
		}
	})
}

func TestLedgerCount(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		ctx := context.Background()
		l := be.open(t, nil).ledger
		for i := range 7 {
			pi := newPI("a", i)
			if i%3 == 0 {
				pi.Status = StatusRequiresPaymentMethod
			}
			if err := l.Create(ctx, pi); err != nil {
				t.Fatal(err)
			}
		}
		if err := l.Create(ctx, newPI("b", 0)); err != nil {
			t.Fatal(err)
		}
		for _, tc := range []struct {
			account string
			want    int
		}{{"a", 4}, {"b", 1}, {"c", 0}} {
			if got, err := CountSucceeded(ctx, l, tc.account); err != nil || got != tc.want {
				t.Errorf("CountSucceeded(%s) = %d, %v; want %d", tc.account, got, err, tc.want)
			}
			// Through ListAll, for a ledger that is no Counter.
			if got, err := CountSucceeded(ctx, struct{ Ledger }{l}, tc.account); err != nil || got != tc.want {
				t.Errorf("CountSucceeded(%s) by listing = %d, %v; want %d", tc.account, got, err, tc.want)
			}
		}
	})
}

func idRange(account string, from, to int) []string {
	var ids []string
	for i := from; i >= to; i-- {
		ids = append(ids, fmt.Sprintf("pi_%s_%03d", account, i))
	}
	return ids
}
