package payments

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/idem-go/idem"
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

// TestMemLedgerCommitsWithOutcome drives MemLedger.Create through the
// idempotency middleware: a PaymentIntent exists only if the outcome
// commits.
func TestMemLedgerCommitsWithOutcome(t *testing.T) {
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
			l := NewMemLedger()
			h := idem.Middleware(memstore.New(memstore.Options{}), idem.Options{OptionalKey: true})(
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if err := l.Create(r.Context(), newPI("a", 1)); err != nil {
						t.Errorf("Create: %v", err)
					}
					if got := l.Len(); got != 0 && tc.key != "" {
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
			if got := l.Len(); got != tc.want {
				t.Errorf("ledger holds %d, want %d", got, tc.want)
			}
		})
	}
}

// foreignStore hands out transactions that are not memstore's.
type foreignStore struct{ idem.Store }

type foreignTx struct{}

func (foreignTx) Complete(context.Context, *idem.Response) error { return nil }
func (foreignTx) Rollback(context.Context) error                 { return nil }

func (foreignStore) Begin(context.Context, *idem.Lease) (idem.Tx, error) { return foreignTx{}, nil }

func TestMemLedgerRefusesForeignTx(t *testing.T) {
	l := NewMemLedger()
	var got error
	h := idem.Middleware(foreignStore{memstore.New(memstore.Options{})}, idem.Options{})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			got = l.Create(r.Context(), newPI("a", 1))
		}))
	req := httptest.NewRequest(http.MethodPost, "/", strings.NewReader("x"))
	req.Header.Set("Idempotency-Key", "k")
	h.ServeHTTP(httptest.NewRecorder(), req)
	if !errors.Is(got, ErrForeignTx) {
		t.Errorf("Create = %v, want ErrForeignTx", got)
	}
	if l.Len() != 0 {
		t.Errorf("ledger holds %d, want 0", l.Len())
	}
}

func TestMemLedgerList(t *testing.T) {
	ctx := context.Background()
	var l MemLedger // the zero value works
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
	for _, q := range []ListQuery{
		{Account: "a", StartingAfter: "pi_nope"},
		{Account: "a", StartingAfter: "pi_b_000"}, // another account's cursor
		{Account: "a", EndingBefore: "pi_nope"},
	} {
		if _, err := l.List(ctx, q); !errors.Is(err, ErrNotFound) {
			t.Errorf("List(%+v) = %v, want ErrNotFound", q, err)
		}
	}

	all, err := ListAll(ctx, &l, "a")
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
	// Callers get copies.
	got, _ := l.Get(ctx, "b", "pi_b_010")
	got.Metadata["n"] = "changed"
	if again, _ := l.Get(ctx, "b", "pi_b_010"); again.Metadata["n"] != "10" {
		t.Error("Get returned the ledger's own map")
	}
}

func idRange(account string, from, to int) []string {
	var ids []string
	for i := from; i >= to; i-- {
		ids = append(ids, fmt.Sprintf("pi_%s_%03d", account, i))
	}
	return ids
}
