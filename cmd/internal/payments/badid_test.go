package payments

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// getBadID sends an authenticated request to srv and returns its status
// and body.
func getBadID(t *testing.T, srv *httptest.Server, method, path, form string) (int, string) {
	t.Helper()
	var body io.Reader
	if form != "" {
		body = strings.NewReader(form)
	}
	req, _ := http.NewRequest(method, srv.URL+path, body)
	req.Header.Set("Authorization", "Bearer sk_test_badid")
	if form != "" {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestGetIntentBadIDIsNotFound: GET /v1/payment_intents/{id} with an id
// that no ledger can keep (NUL, bytes that are not UTF-8, over
// MaxStringLen) names nothing: 404 resource_missing, as at Stripe, never
// the 500 of a ledger (PostgreSQL, SQLSTATE 22021) that refuses it.
func TestGetIntentBadIDIsNotFound(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		db := be.open(t, nil)
		srv := httptest.NewServer(NewServer(Config{Store: db.store, Ledger: db.ledger}))
		defer srv.Close()
		for _, id := range []string{"pi_%00", "pi_%FF", "pi_a%00b", "pi_" + strings.Repeat("x", MaxStringLen)} {
			status, b := getBadID(t, srv, "GET", "/v1/payment_intents/"+id, "")
			if status != http.StatusNotFound || !strings.Contains(b, `"resource_missing"`) {
				t.Errorf("GET /v1/payment_intents/%.20s…: %d %s; want 404 resource_missing", id, status, b)
			}
		}
	})
}

// TestBadIDsElsewhereAreClientErrors: every other path that takes an id
// (a list's cursor, a refund's payment_intent, the refund list's filter)
// answers such an id 400, before the ledger.
func TestBadIDsElsewhereAreClientErrors(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		db := be.open(t, nil)
		srv := httptest.NewServer(NewServer(Config{Store: db.store, Ledger: db.ledger}))
		defer srv.Close()
		for _, id := range []string{"pi_%00", "pi_%FF"} {
			for _, tc := range []struct{ method, path, form string }{
				{"GET", "/v1/payment_intents?starting_after=" + id, ""},
				{"GET", "/v1/payment_intents?ending_before=" + id, ""},
				{"GET", "/v1/refunds?payment_intent=" + id, ""},
				{"GET", "/v1/refunds?starting_after=re_" + id, ""},
				{"POST", "/v1/refunds", "payment_intent=" + id},
			} {
				if status, b := getBadID(t, srv, tc.method, tc.path, tc.form); status != http.StatusBadRequest {
					t.Errorf("%s %s %s: %d %s; want 400", tc.method, tc.path, tc.form, status, b)
				}
			}
		}
	})
}

// TestLedgerBadIDIsNotFound: the ledgers themselves answer an id they
// cannot keep with ErrNotFound (the PostgreSQL ledger does not send it),
// a safety net for a caller that did not check it.
func TestLedgerBadIDIsNotFound(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		db := be.open(t, nil)
		ctx := context.Background()
		acct := AccountFor("sk_test_badid")
		for _, id := range []string{"pi_\x00", "pi_\xff"} {
			if _, err := db.ledger.Get(ctx, acct, id); !errors.Is(err, ErrNotFound) {
				t.Errorf("Get(%q): %v; want ErrNotFound", id, err)
			}
			if _, err := db.ledger.List(ctx, ListQuery{Account: acct, Limit: 10, StartingAfter: id}); !errors.Is(err, ErrNotFound) {
				t.Errorf("List(starting_after %q): %v; want ErrNotFound", id, err)
			}
		}
	})
}
