package payments

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/stripe/stripe-go/v82"
)

// stripeClient returns a Client, stripe-go inside, for the gateway at srv.
func stripeClient(srv *httptest.Server) *Client {
	return NewClient(ClientConfig{BaseURL: srv.URL, APIKey: testKey, HTTPClient: srv.Client()})
}

// TestRefundsThroughStripeGo: refunds through the official client against
// the gateway's HTTP API, on every backend: partial and full refunds,
// replays, the same key with other parameters, refusals and the list.
func TestRefundsThroughStripeGo(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		ctx := context.Background()
		db := be.open(t, nil)
		srv, _ := setup(t, Config{Store: db.store, Ledger: db.ledger})
		c := stripeClient(srv)
		ch, err := c.Charge(ctx, ChargeRequest{Amount: 1000, Currency: "eur", IdempotencyKey: "pay-1"})
		if err != nil {
			t.Fatal(err)
		}

		first, err := c.Refund(ctx, RefundRequest{PaymentIntent: ch.ID, Amount: 300, IdempotencyKey: "refund-1"})
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(first.ID, "re_") || first.PaymentIntent != ch.ID || first.Amount != 300 || first.Status != "succeeded" || first.Replayed {
			t.Errorf("refund = %+v", first)
		}
		again, err := c.Refund(ctx, RefundRequest{PaymentIntent: ch.ID, Amount: 300, IdempotencyKey: "refund-1"})
		if err != nil {
			t.Fatal(err)
		}
		if again.ID != first.ID || !again.Replayed {
			t.Errorf("repeat = %+v, want a replay of %s", again, first.ID)
		}
		_, err = c.Refund(ctx, RefundRequest{PaymentIntent: ch.ID, Amount: 200, IdempotencyKey: "refund-1"})
		var se *stripe.Error
		if !errors.As(err, &se) || se.Type != "idempotency_error" || se.HTTPStatusCode != http.StatusBadRequest {
			t.Errorf("same key, other amount: err = %v, want 400 idempotency_error", err)
		}
		if _, err := c.Refund(ctx, RefundRequest{PaymentIntent: ch.ID, Amount: 701, IdempotencyKey: "refund-too-large"}); !errors.Is(err, ErrRefundTooLarge) {
			t.Errorf("refund of 701 out of 700 left: err = %v, want ErrRefundTooLarge", err)
		}
		rest, err := c.Refund(ctx, RefundRequest{PaymentIntent: ch.ID, IdempotencyKey: "refund-rest"})
		if err != nil {
			t.Fatal(err)
		}
		if rest.Amount != 700 {
			t.Errorf("refund of the rest = %d, want 700", rest.Amount)
		}
		if _, err := c.Refund(ctx, RefundRequest{PaymentIntent: ch.ID, IdempotencyKey: "refund-more"}); !errors.Is(err, ErrAlreadyRefunded) {
			t.Errorf("refund of a refunded payment: err = %v, want ErrAlreadyRefunded", err)
		}
		// The first refund's key still replays it.
		if r, err := c.Refund(ctx, RefundRequest{PaymentIntent: ch.ID, Amount: 300, IdempotencyKey: "refund-1"}); err != nil || r.ID != first.ID {
			t.Errorf("repeat after the full refund = %+v, %v; want %s", r, err, first.ID)
		}

		if _, err := c.Refund(ctx, RefundRequest{PaymentIntent: "pi_missing", IdempotencyKey: "refund-missing"}); !errors.Is(err, ErrNotFound) {
			t.Errorf("unknown PaymentIntent: err = %v, want ErrNotFound", err)
		}
		var de *DeclinedError
		if _, err := c.Charge(ctx, ChargeRequest{Amount: 100, Currency: "eur", PaymentMethod: "pm_card_chargeDeclined", IdempotencyKey: "pay-declined"}); !errors.As(err, &de) || de.Charge == nil {
			t.Fatalf("declined charge: err = %v", err)
		}
		if _, err := c.Refund(ctx, RefundRequest{PaymentIntent: de.Charge.ID, IdempotencyKey: "refund-declined"}); !errors.Is(err, ErrNotRefundable) {
			t.Errorf("refund of a declined payment: err = %v, want ErrNotRefundable", err)
		}
		// Another account sees no such PaymentIntent.
		other := NewClient(ClientConfig{BaseURL: srv.URL, APIKey: "sk_test_bob", HTTPClient: srv.Client()})
		if _, err := other.Refund(ctx, RefundRequest{PaymentIntent: ch.ID, IdempotencyKey: "refund-other"}); !errors.Is(err, ErrNotFound) {
			t.Errorf("another account's PaymentIntent: err = %v, want ErrNotFound", err)
		}

		list, err := c.Refunds(ctx, ch.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := refundIDs(list), []string{rest.ID, first.ID}; !equal(got, want) {
			t.Errorf("Refunds = %v, want %v (newest first)", got, want)
		}
		if list, err := other.Refunds(ctx, ch.ID); err != nil || len(list) != 0 {
			t.Errorf("another account's Refunds = %v, %v; want none", list, err)
		}
		all, err := ListAllRefunds(ctx, db.ledger, AccountFor(testKey), "")
		if err != nil || len(all) != 2 {
			t.Errorf("ListAllRefunds = %d refunds, %v; want 2", len(all), err)
		}
		pi, err := db.ledger.Get(ctx, AccountFor(testKey), ch.ID)
		if err != nil || pi.AmountRefunded != 1000 || pi.Status != StatusSucceeded {
			t.Errorf("PaymentIntent after refunds = %+v, %v; want succeeded, 1000 refunded", pi, err)
		}
	})
}

func refundIDs(rs []*Refund) []string {
	ids := make([]string, len(rs))
	for i, r := range rs {
		ids[i] = r.ID
	}
	return ids
}

func equal(a, b []string) bool {
	return fmt.Sprint(a) == fmt.Sprint(b)
}

// TestRefundParams: the parameters of POST /v1/refunds and their limits.
func TestRefundParams(t *testing.T) {
	srv, _ := setup(t, Config{})
	pi := decodePI(t, create(t, srv, "pay", chargeForm(500, "pm_card_visa")).body)
	for _, tc := range []struct {
		name        string
		form        url.Values
		status      int
		code, param string
	}{
		{"no payment_intent", url.Values{"amount": {"1"}}, 400, "parameter_missing", "payment_intent"},
		{"payment_intent too long", url.Values{"payment_intent": {strings.Repeat("p", 256)}}, 400, "parameter_invalid_string", "payment_intent"},
		{"amount zero", url.Values{"payment_intent": {pi.ID}, "amount": {"0"}}, 400, "parameter_invalid_integer", "amount"},
		{"amount over maximum", url.Values{"payment_intent": {pi.ID}, "amount": {"100000000"}}, 400, "parameter_invalid_integer", "amount"},
		{"amount over what is left", url.Values{"payment_intent": {pi.ID}, "amount": {"501"}}, 400, "amount_too_large", "amount"},
		{"bad reason", url.Values{"payment_intent": {pi.ID}, "reason": {"bored"}}, 400, "parameter_invalid_string", "reason"},
		{"metadata value too long", url.Values{"payment_intent": {pi.ID}, "metadata[k]": {strings.Repeat("v", 501)}}, 400, "parameter_invalid_string", "metadata[k]"},
		{"charge", url.Values{"payment_intent": {pi.ID}, "charge": {"ch_1"}}, 400, "parameter_unknown", "charge"},
		{"unknown PaymentIntent", url.Values{"payment_intent": {"pi_nope"}}, 404, "resource_missing", "payment_intent"},
		{"with reason and metadata", url.Values{"payment_intent": {pi.ID}, "amount": {"100"}, "reason": {"requested_by_customer"}, "metadata[why]": {"test"}}, 200, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := do(t, srv.Client(), http.MethodPost, srv.URL+"/v1/refunds", testKey, "key-"+strings.ReplaceAll(tc.name, " ", "-"), tc.form.Encode())
			wantStatus(t, r, tc.status)
			if tc.status == http.StatusOK {
				var rf RefundRecord
				if err := json.Unmarshal(r.body, &rf); err != nil {
					t.Fatal(err)
				}
				if rf.Object != "refund" || rf.Amount != 100 || rf.Currency != "eur" || rf.PaymentIntent != pi.ID || rf.Reason == nil || *rf.Reason != "requested_by_customer" || rf.Metadata["why"] != "test" || rf.Created == 0 {
					t.Errorf("refund = %s", r.body)
				}
				return
			}
			if e := decodeErr(t, r.body); e.Type != "invalid_request_error" || e.Code != tc.code || e.Param != tc.param {
				t.Errorf("error = %s %s param %q, want invalid_request_error %s param %q", e.Type, e.Code, e.Param, tc.code, tc.param)
			}
		})
	}
}

// TestRefundList: GET /v1/refunds is Stripe's list object, newest first,
// by pages, filtered by payment_intent.
func TestRefundList(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		db := be.open(t, nil)
		srv, _ := setup(t, Config{Store: db.store, Ledger: db.ledger})
		pis := []string{
			decodePI(t, create(t, srv, "pay-a", chargeForm(1000, "pm_card_visa")).body).ID,
			decodePI(t, create(t, srv, "pay-b", chargeForm(1000, "pm_card_visa")).body).ID,
		}
		var ids [2][]string // by PaymentIntent, newest first
		for i := range 5 {
			for j, pi := range pis {
				r := do(t, srv.Client(), http.MethodPost, srv.URL+"/v1/refunds", testKey, fmt.Sprintf("refund-%d-%d", i, j), url.Values{"payment_intent": {pi}, "amount": {"10"}}.Encode())
				wantStatus(t, r, http.StatusOK)
				var rf RefundRecord
				if err := json.Unmarshal(r.body, &rf); err != nil {
					t.Fatal(err)
				}
				ids[j] = append([]string{rf.ID}, ids[j]...)
			}
		}
		get := func(query string) refundList {
			t.Helper()
			r := do(t, srv.Client(), http.MethodGet, srv.URL+"/v1/refunds?"+query, testKey, "", "")
			wantStatus(t, r, http.StatusOK)
			var l refundList
			if err := json.Unmarshal(r.body, &l); err != nil {
				t.Fatal(err)
			}
			if l.Object != "list" || l.URL != "/v1/refunds" {
				t.Errorf("list envelope = %s %s", l.Object, l.URL)
			}
			return l
		}
		recIDs := func(rs []*RefundRecord) []string {
			var out []string
			for _, r := range rs {
				out = append(out, r.ID)
			}
			return out
		}
		l := get("payment_intent=" + pis[0] + "&limit=2")
		if got, want := recIDs(l.Data), ids[0][:2]; !equal(got, want) || !l.HasMore {
			t.Errorf("first page = %v has_more %v, want %v true", got, l.HasMore, want)
		}
		l = get("payment_intent=" + pis[0] + "&limit=2&starting_after=" + ids[0][3])
		if got, want := recIDs(l.Data), ids[0][4:]; !equal(got, want) || l.HasMore {
			t.Errorf("last page = %v has_more %v, want %v false", got, l.HasMore, want)
		}
		l = get("payment_intent=" + pis[1] + "&limit=2&ending_before=" + ids[1][4])
		if got, want := recIDs(l.Data), ids[1][2:4]; !equal(got, want) || !l.HasMore {
			t.Errorf("page before the oldest = %v has_more %v, want %v true", got, l.HasMore, want)
		}
		if l := get(""); len(l.Data) != DefaultListLimit || l.HasMore {
			t.Errorf("unfiltered = %d has_more %v, want all %d, false", len(l.Data), l.HasMore, DefaultListLimit)
		}
		if l := get("limit=9"); len(l.Data) != 9 || !l.HasMore {
			t.Errorf("unfiltered, limit 9 = %d has_more %v, want 9 true", len(l.Data), l.HasMore)
		}
		for _, q := range []string{"limit=0", "limit=101", "starting_after=re_nope", "payment_intent=" + strings.Repeat("p", 256), "charge=ch_1"} {
			if r := do(t, srv.Client(), http.MethodGet, srv.URL+"/v1/refunds?"+q, testKey, "", ""); r.status != http.StatusBadRequest {
				t.Errorf("GET /v1/refunds?%.40s: status %d, want 400", q, r.status)
			}
		}
	})
}

// TestConcurrentRefunds: refunds of one PaymentIntent under different
// keys, at once, never give back more than it received.
func TestConcurrentRefunds(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		ctx := context.Background()
		db := be.open(t, nil)
		srv, _ := setup(t, Config{Store: db.store, Ledger: db.ledger})
		c := stripeClient(srv)
		ch, err := c.Charge(ctx, ChargeRequest{Amount: 1000, Currency: "eur", IdempotencyKey: "pay"})
		if err != nil {
			t.Fatal(err)
		}
		const n = 12 // of 300 each: three fit
		var (
			wg              sync.WaitGroup
			mu              sync.Mutex
			refunded, tooLg int
		)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := c.Refund(ctx, RefundRequest{PaymentIntent: ch.ID, Amount: 300, IdempotencyKey: fmt.Sprint("refund-", i)})
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil:
					refunded++
				case errors.Is(err, ErrRefundTooLarge), errors.Is(err, ErrAlreadyRefunded):
					tooLg++
				default:
					t.Errorf("refund %d: %v", i, err)
				}
			}()
		}
		wg.Wait()
		if refunded != 3 || tooLg != n-3 {
			t.Errorf("%d refunded and %d refused, want 3 and %d", refunded, tooLg, n-3)
		}
		list, err := c.Refunds(ctx, ch.ID)
		if err != nil {
			t.Fatal(err)
		}
		var sum int64
		for _, r := range list {
			sum += r.Amount
		}
		if len(list) != 3 || sum != 900 {
			t.Errorf("%d refunds of %d in all, want 3 of 900", len(list), sum)
		}
		if r, err := c.Refund(ctx, RefundRequest{PaymentIntent: ch.ID, IdempotencyKey: "rest"}); err != nil || r.Amount != 100 {
			t.Errorf("refund of the rest = %+v, %v; want 100", r, err)
		}
	})
}

// failingRefunds fails every CreateRefund after it was made.
type failingRefunds struct{ Ledger }

func (l failingRefunds) CreateRefund(ctx context.Context, r *RefundRecord) error {
	if err := l.Ledger.CreateRefund(ctx, r); err != nil {
		return err
	}
	return errors.New("injected failure after the refund")
}

// TestRefundRolledBack: a refund whose request fails after the ledger
// wrote it is rolled back with the request, on every backend, and what it
// would have refunded is free again (in memory: its hold is dropped).
func TestRefundRolledBack(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		ctx := context.Background()
		db := be.open(t, nil)
		srv, _ := setup(t, Config{Store: db.store, Ledger: db.ledger})
		c := stripeClient(srv)
		ch, err := c.Charge(ctx, ChargeRequest{Amount: 1000, Currency: "eur", IdempotencyKey: "pay"})
		if err != nil {
			t.Fatal(err)
		}
		failing, _ := setup(t, Config{Store: db.store, Ledger: failingRefunds{db.ledger}})
		r := do(t, failing.Client(), http.MethodPost, failing.URL+"/v1/refunds", testKey, "refund", url.Values{"payment_intent": {ch.ID}}.Encode())
		wantStatus(t, r, http.StatusInternalServerError)
		if list, err := c.Refunds(ctx, ch.ID); err != nil || len(list) != 0 {
			t.Errorf("refunds after the failed one = %d, %v; want none", len(list), err)
		}
		rf, err := c.Refund(ctx, RefundRequest{PaymentIntent: ch.ID, IdempotencyKey: "refund"})
		if err != nil || rf.Amount != 1000 || rf.Replayed {
			t.Errorf("retry = %+v, %v; want a refund of 1000", rf, err)
		}
	})
}
