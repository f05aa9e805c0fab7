package payments

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/stripe/stripe-go/v82"
)

// charge pays amount with key and metadata through c, failing the test on
// an error other than a decline.
func chargeWith(t *testing.T, c *Client, key, pm string, md map[string]string) *Charge {
	t.Helper()
	ch, err := c.Charge(context.Background(), ChargeRequest{Amount: 1000, Currency: "eur", PaymentMethod: pm, IdempotencyKey: key, Metadata: md})
	var de *DeclinedError
	switch {
	case errors.As(err, &de) && de.Charge != nil:
		return de.Charge
	case err != nil:
		t.Fatalf("charge %s: %v", key, err)
	}
	return ch
}

func searchIDs(t *testing.T, c *Client, query string) []string {
	t.Helper()
	var ids []string
	for ch, err := range c.Search(context.Background(), query) {
		if err != nil {
			t.Fatalf("search %q: %v", query, err)
		}
		ids = append(ids, ch.ID)
	}
	return ids
}

// TestSearchThroughStripeGo: GET /v1/payment_intents/search through the
// official client, on every backend: FindByOrderRef finds an order's
// succeeded payment (the oldest of several), nothing for an unknown
// order or another account's, and the supported query forms.
func TestSearchThroughStripeGo(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		ctx := context.Background()
		db := be.open(t, nil)
		srv, _ := setup(t, Config{Store: db.store, Ledger: db.ledger})
		c := stripeClient(srv)
		other := NewClient(ClientConfig{BaseURL: srv.URL, APIKey: "sk_test_bob", HTTPClient: srv.Client()})

		declined := chargeWith(t, c, "pay-declined", "pm_card_chargeDeclined", map[string]string{"order_ref": "ord_1"})
		paid := chargeWith(t, c, "pay-1", "pm_card_visa", map[string]string{"order_ref": "ord_1"})
		ord2 := chargeWith(t, c, "pay-2", "pm_card_visa", map[string]string{"order_ref": "ord_2"})
		bobs := chargeWith(t, other, "pay-bob", "pm_card_visa", map[string]string{"order_ref": "ord_3"})
		if declined.Status != StatusRequiresPaymentMethod || paid.Status != StatusSucceeded {
			t.Fatalf("setup: declined %s, paid %s", declined.Status, paid.Status)
		}

		found, err := c.FindByOrderRef(ctx, "ord_1")
		if err != nil || found == nil || found.ID != paid.ID || found.Amount != 1000 || found.Metadata["order_ref"] != "ord_1" {
			t.Fatalf("FindByOrderRef(ord_1) = %+v, %v; want %s (the succeeded one, not the declined %s)", found, err, paid.ID, declined.ID)
		}
		if found, err := c.FindByOrderRef(ctx, "ord_missing"); found != nil || err != nil {
			t.Errorf("FindByOrderRef(ord_missing) = %+v, %v; want nil, nil", found, err)
		}
		if found, err := c.FindByOrderRef(ctx, "ord_3"); found != nil || err != nil {
			t.Errorf("FindByOrderRef of another account's order = %+v, %v; want nil, nil", found, err)
		}
		if found, err := other.FindByOrderRef(ctx, "ord_3"); err != nil || found == nil || found.ID != bobs.ID {
			t.Errorf("bob's FindByOrderRef(ord_3) = %+v, %v; want %s", found, err, bobs.ID)
		}

		// Without the status clause, every status; newest first.
		if got, want := searchIDs(t, c, "metadata['order_ref']:'ord_1'"), []string{paid.ID, declined.ID}; !equal(got, want) {
			t.Errorf("search ord_1 = %v, want %v", got, want)
		}
		for _, q := range []string{
			`metadata["order_ref"]:"ord_2"`,
			`status:'succeeded' metadata['order_ref']:'ord_2'`,
			`metadata['order_ref']:'ord_2' and status:"succeeded"`,
			"  metadata['order_ref']:'ord_2'\tAND  status:'succeeded'  ",
		} {
			if got, want := searchIDs(t, c, q), []string{ord2.ID}; !equal(got, want) {
				t.Errorf("search %q = %v, want %v", q, got, want)
			}
		}
		if got := searchIDs(t, c, "metadata['order_ref']:'ord_1' AND status:'canceled'"); len(got) != 0 {
			t.Errorf("search of canceled ones = %v, want none", got)
		}

		// Quotes and backslashes in a value; a key that is not an
		// identifier (SQLite searches it without its index).
		odd := `it's "odd" \ x`
		oddCh := chargeWith(t, c, "pay-odd", "pm_card_visa", map[string]string{"note-1.x": odd})
		if got, want := searchIDs(t, c, "metadata['note-1.x']:"+QuoteSearchString(odd)), []string{oddCh.ID}; !equal(got, want) {
			t.Errorf("search of an escaped value = %v, want %v", got, want)
		}
		if got := searchIDs(t, c, "metadata['note-1.x']:'it'"); len(got) != 0 {
			t.Errorf("search of a prefix = %v, want none (':' is an exact match)", got)
		}

		// Two succeeded payments for one order: the oldest is the order's.
		again := chargeWith(t, c, "pay-1-again", "pm_card_visa", map[string]string{"order_ref": "ord_1"})
		if found, err := c.FindByOrderRef(ctx, "ord_1"); err != nil || found == nil || found.ID != paid.ID {
			t.Errorf("FindByOrderRef with %s and %s = %+v, %v; want the oldest, %s", paid.ID, again.ID, found, err, paid.ID)
		}
	})
}

// TestSearchPages: stripe-go follows next_page through every page, and
// the pages hold each match once, newest first.
func TestSearchPages(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		db := be.open(t, nil)
		srv, _ := setup(t, Config{Store: db.store, Ledger: db.ledger})
		c := stripeClient(srv)
		var want []string
		for i := range 12 {
			ch := chargeWith(t, c, fmt.Sprintf("pay-%d", i), "pm_card_visa", map[string]string{"batch": "b1"})
			want = append([]string{ch.ID}, want...)
			chargeWith(t, c, fmt.Sprintf("other-%d", i), "pm_card_visa", map[string]string{"batch": "b2"})
		}
		sc := stripe.NewClient(testKey, stripe.WithBackends(stripe.NewBackendsWithConfig(&stripe.BackendConfig{
			URL: stripe.String(srv.URL), HTTPClient: srv.Client(), LeveledLogger: &stripe.LeveledLogger{Level: stripe.LevelNull},
		})))
		params := &stripe.PaymentIntentSearchParams{}
		params.Query = "metadata['batch']:'b1'"
		params.Limit = stripe.Int64(5)
		var got []string
		for pi, err := range sc.V1PaymentIntents.Search(context.Background(), params) {
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, pi.ID)
		}
		if !equal(got, want) {
			t.Errorf("pages of 5 = %v, want %v", got, want)
		}

		// The envelope of a page, as Stripe's.
		r := do(t, srv.Client(), http.MethodGet, srv.URL+searchURL+"?"+url.Values{"query": {"metadata['batch']:'b1'"}, "limit": {"10"}}.Encode(), testKey, "", "")
		wantStatus(t, r, http.StatusOK)
		var env struct {
			Object   string            `json:"object"`
			Data     []json.RawMessage `json:"data"`
			HasMore  bool              `json:"has_more"`
			NextPage *string           `json:"next_page"`
			URL      string            `json:"url"`
		}
		if err := json.Unmarshal(r.body, &env); err != nil {
			t.Fatal(err)
		}
		if env.Object != "search_result" || len(env.Data) != 10 || !env.HasMore || env.NextPage == nil || env.URL != "/v1/payment_intents/search" {
			t.Errorf("first page = %s", r.body)
		}
		r = do(t, srv.Client(), http.MethodGet, srv.URL+searchURL+"?"+url.Values{"query": {"metadata['batch']:'b1'"}, "page": {*env.NextPage}}.Encode(), testKey, "", "")
		wantStatus(t, r, http.StatusOK)
		env.NextPage = nil
		if err := json.Unmarshal(r.body, &env); err != nil {
			t.Fatal(err)
		}
		if len(env.Data) != 2 || env.HasMore || env.NextPage != nil || !strings.Contains(string(r.body), `"next_page": null`) {
			t.Errorf("last page = %s", r.body)
		}
		r = do(t, srv.Client(), http.MethodGet, srv.URL+searchURL+"?"+url.Values{"query": {"metadata['batch']:'none'"}}.Encode(), testKey, "", "")
		wantStatus(t, r, http.StatusOK)
		if !strings.Contains(string(r.body), `"data": []`) {
			t.Errorf("empty result = %s, want data []", r.body)
		}
	})
}

// TestSearchRefusals: every query outside the supported subset, and every
// parameter beyond its bound, is 400 invalid_request_error naming it, on
// every backend (a NUL never reaches PostgreSQL), through stripe-go too.
func TestSearchRefusals(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		db := be.open(t, nil)
		srv, _ := setup(t, Config{Store: db.store, Ledger: db.ledger})
		c := stripeClient(srv)
		chargeWith(t, c, "pay-1", "pm_card_visa", map[string]string{"order_ref": "ord_1"})

		for _, q := range []string{
			"",
			"   ",
			"status:'succeeded'", // no metadata clause
			"metadata['order_ref']:'ord_1' OR status:'succeeded'", // OR
			"-metadata['order_ref']:'ord_1'",                      // negation
			"metadata['order_ref']~'ord'",                         // substring
			"amount>100",                                          // another field, operator
			"amount:1000",                                         // another field
			"metadata['order_ref']:ord_1",                         // unquoted
			"metadata[order_ref]:'ord_1'",                         // unquoted key
			"metadata['order_ref']:'ord_1",                        // unterminated
			"metadata['order_ref']:'o\\rd'",                       // bad escape
			"metadata['order_ref']:'ord_1' AND metadata['x']:'y'", // two metadata clauses
			"metadata['order_ref']:'ord_1' AND status:'bogus'",    // no such status
			"metadata['order_ref']:'ord_1' AND status:'succeeded' status:'succeeded'",
			"metadata['order_ref']:'ord_1' AND",               // dangling AND
			"metadata['order_ref']:'ord_1'status:'succeeded'", // no separator
			"metadata['']:'x'",                                // empty key
			"metadata['" + strings.Repeat("k", MaxMetadataKeyLen+1) + "']:'x'",
			"metadata['order_ref']:'" + strings.Repeat("v", MaxMetadataValueLen+1) + "'",
			"metadata['order_ref']:'ord\x00'", // NUL
			"metadata['order_ref']:'\xff'",    // not UTF-8
			"metadata['order_ref']:'" + strings.Repeat("v", MaxSearchQueryLen) + "'",
		} {
			r := do(t, srv.Client(), http.MethodGet, srv.URL+searchURL+"?"+url.Values{"query": {q}}.Encode(), testKey, "", "")
			if r.status != http.StatusBadRequest {
				t.Errorf("query %q: %d %s, want 400", q, r.status, r.body)
				continue
			}
			if e := decodeErr(t, r.body); e.Type != "invalid_request_error" || e.Param != "query" || e.Code != codeInvalidString {
				t.Errorf("query %q: error %+v, want invalid_request_error parameter_invalid_string on query", q, e)
			}
		}

		for _, tc := range []struct {
			query url.Values
			param string
			code  string
		}{
			{url.Values{}, "query", codeMissing},
			{url.Values{"query": {"metadata['a']:'b'"}, "limit": {"0"}}, "limit", codeInvalidInteger},
			{url.Values{"query": {"metadata['a']:'b'"}, "limit": {"101"}}, "limit", codeInvalidInteger},
			{url.Values{"query": {"metadata['a']:'b'"}, "limit": {"x"}}, "limit", codeInvalidInteger},
			{url.Values{"query": {"metadata['a']:'b'"}, "page": {"pi_nothing"}}, "page", codeInvalidString},
			{url.Values{"query": {"metadata['a']:'b'"}, "page": {""}}, "page", codeInvalidString},
			{url.Values{"query": {"metadata['a']:'b'"}, "page": {"pi_\x00"}}, "page", codeInvalidString},
			{url.Values{"query": {"metadata['a']:'b'"}, "starting_after": {"pi_1"}}, "starting_after", codeUnknown},
			{url.Values{"query": {"metadata['a']:'b'", "metadata['c']:'d'"}}, "query", codeInvalidString},
		} {
			r := do(t, srv.Client(), http.MethodGet, srv.URL+searchURL+"?"+tc.query.Encode(), testKey, "", "")
			if r.status != http.StatusBadRequest {
				t.Errorf("%s: %d %s, want 400", tc.query.Encode(), r.status, r.body)
				continue
			}
			if e := decodeErr(t, r.body); e.Param != tc.param || e.Code != tc.code {
				t.Errorf("%s: error %+v, want %s on %s", tc.query.Encode(), e, tc.code, tc.param)
			}
		}
		// Without a key: 401, as every route.
		if r := do(t, srv.Client(), http.MethodGet, srv.URL+searchURL+"?query=x", "", "", ""); r.status != http.StatusUnauthorized {
			t.Errorf("search without an API key: %d", r.status)
		}

		// Through stripe-go: a *stripe.Error, status 400.
		var err error
		for _, e := range c.Search(context.Background(), "amount>1") {
			err = e
		}
		var se *stripe.Error
		if !errors.As(err, &se) || se.HTTPStatusCode != http.StatusBadRequest || se.Param != "query" || string(se.Code) != codeInvalidString {
			t.Errorf("Client.Search of a refused query: err = %v, want a 400 *stripe.Error on query", err)
		}
	})
}

// TestSQLiteSearchUsesIndex: on SQLite the order_ref clause is written so
// that the index payment_intents_order_ref serves it.
func TestSQLiteSearchUsesIndex(t *testing.T) {
	db := openSQLiteBackend(t, nil)
	l := db.ledger.(*SQLiteLedger)
	query, args := sqliteSearchSQL(SearchQuery{Account: "acct", MetadataKey: "order_ref", MetadataValue: "ord_1", Status: StatusSucceeded, Limit: 10}, false, 0)
	rows, err := l.db.Query(`EXPLAIN QUERY PLAN `+query, args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var plan []string
	for rows.Next() {
		var id, parent, unused int
		var detail string
		if err := rows.Scan(&id, &parent, &unused, &detail); err != nil {
			t.Fatal(err)
		}
		plan = append(plan, detail)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(plan, "\n"), "payment_intents_order_ref") {
		t.Errorf("query plan %q does not use payment_intents_order_ref", plan)
	}
}
