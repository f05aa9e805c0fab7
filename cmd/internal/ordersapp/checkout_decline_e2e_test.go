package ordersapp

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/idem-go/idem/cmd/internal/payments"
)

// TestCheckoutDeclineE2E drives the checkout page in Chromium against
// an in-process gateway that declines the cart's amount: the page shows
// the 402 problem's title and detail, the attempt ends (a final outcome)
// after one POST, no order is made, the ledger holds one declined
// PaymentIntent and no succeeded one, and a reload sends nothing.
func TestCheckoutDeclineE2E(t *testing.T) {
	const declineOver = 1000 // the default cart is 2 × 12.99 + 8.50 EUR
	browser := checkoutBrowser(t)
	s := checkoutStart(t, 0, false, func(c *Config) { c.gatewayDeclineOver = declineOver })
	tab := checkoutTab(t, browser, s)
	checkoutDo(t, tab, 10*time.Second, "click", chromedp.Click(chromedp.CSS(`#place`)))
	o := checkoutWaitOutcome(t, tab, 20*time.Second)
	t.Logf("page's requests:\n%s", o.Log)

	posts := s.postsSeen()
	if len(posts) != 1 {
		t.Fatalf("%d POST /v1/orders, want exactly 1\nlog: %s", len(posts), o.Log)
	}
	post := posts[0]
	var body struct {
		Items []struct {
			Quantity  int64 `json:"quantity"`
			UnitPrice int64 `json:"unit_price"`
		} `json:"items"`
	}
	if err := json.Unmarshal([]byte(post.body), &body); err != nil {
		t.Fatalf("the page's body %s: %v", post.body, err)
	}
	var total int64
	for _, it := range body.Items {
		total += it.Quantity * it.UnitPrice
	}
	if total <= declineOver {
		t.Fatalf("the page's cart totals %d, not over the gateway's limit %d", total, declineOver)
	}
	var prob struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
	}
	if err := json.Unmarshal([]byte(post.answer), &prob); err != nil || post.status != 402 || prob.Status != 402 || prob.Title == "" || prob.Detail == "" {
		t.Fatalf("the service answered %d %s (%v); want a 402 problem with a title and a detail", post.status, post.answer, err)
	}

	// The page: the problem's title and detail, a final outcome.
	detail := checkoutEval[string](t, tab, `(() => { const e = document.getElementById('problem-detail'); return e ? e.textContent : ''; })()`)
	headline := checkoutEval[string](t, tab, `document.querySelector('#result .headline').textContent`)
	if o.State != "error" || o.Status != "402" || o.Replayed != "false" || o.OrderID != "" || o.Pending || o.Listed != "0" {
		t.Errorf("page: state %q, status %q, replayed %q, order %q, attempt still pending %v, %q orders listed; want error, 402, false, none, false, 0\npage:\n%s",
			o.State, o.Status, o.Replayed, o.OrderID, o.Pending, o.Listed, o.Text)
	}
	if !strings.Contains(headline, prob.Title) || detail != prob.Detail || !strings.Contains(o.Text, prob.Type) {
		t.Errorf("page shows headline %q, detail %q; want the problem's title %q, detail %q and type %q\npage:\n%s",
			headline, detail, prob.Title, prob.Detail, prob.Type, o.Text)
	}
	if !strings.Contains(o.Log, "402 Payment Required") {
		t.Errorf("the page's log does not show the 402\nlog: %s", o.Log)
	}
	if k := checkoutEval[string](t, tab, `document.getElementById('key').textContent`); !strings.Contains(k, post.key) || !strings.Contains(k, "final answer 402") {
		t.Errorf("the page's key reads %q; want %s ended with a final answer 402", k, post.key)
	}

	// The repository and the gateway's ledger.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	list, _, err := s.srv.backend.repo.List(ctx, o.User, 100, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 0 {
		t.Errorf("%d orders of %s, want none: %+v", len(list), o.User, list)
	}
	pis, err := payments.ListAll(ctx, s.srv.ledger, payments.AccountFor(s.payKey))
	if err != nil {
		t.Fatal(err)
	}
	if len(pis) != 1 {
		t.Fatalf("%d PaymentIntents in the ledger, want one declined", len(pis))
	}
	pi := pis[0]
	if pi.Status != payments.StatusRequiresPaymentMethod || pi.AmountReceived != 0 || pi.Amount != total ||
		pi.LastPaymentError == nil || pi.LastPaymentError.DeclineCode != "insufficient_funds" {
		t.Errorf("PaymentIntent %s: %s, amount %d, received %d, error %+v; want %s, %d, 0, declined for insufficient_funds",
			pi.ID, pi.Status, pi.Amount, pi.AmountReceived, pi.LastPaymentError, payments.StatusRequiresPaymentMethod, total)
	}

	// A reload after the final outcome resumes nothing and sends nothing.
	checkoutDo(t, tab, 20*time.Second, "reloading the page",
		chromedp.Reload(),
		chromedp.Poll[chromedp.Void](`document.body.dataset.state === 'idle' && document.getElementById('orders').dataset.count !== undefined`,
			chromedp.WithPollingTimeout(15*time.Second), chromedp.WithPollingInterval(50*time.Millisecond)))
	after := checkoutEval[struct {
		Pending bool   `json:"pending"`
		Log     string `json:"log"`
		Key     string `json:"key"`
		Listed  string `json:"listed"`
	}](t, tab, `({
		pending: sessionStorage.getItem('checkout.attempt') !== null,
		log: document.getElementById('log').innerText,
		key: document.getElementById('key').textContent,
		listed: document.getElementById('orders').dataset.count,
	})`)
	if n := len(s.postsSeen()); n != 1 || after.Pending || strings.Contains(after.Log, "Resuming") || after.Listed != "0" || !strings.Contains(after.Key, post.key) {
		t.Errorf("after the reload: %d POST /v1/orders, attempt pending %v, %q orders listed, key %q; want 1, false, 0, the declined attempt's %s\nlog: %s",
			n, after.Pending, after.Listed, after.Key, post.key, after.Log)
	}
}
