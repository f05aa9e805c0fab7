package ordersapp

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// TestCheckoutTokenSignInE2E drives the checkout page in Chromium on a service
// without guest checkout: the page says it is off and how to get a
// token, makes no guest, takes a pasted token from `orders token`, and
// places one order for that token's user; a refused token asks for
// another instead of signing in a guest.
func TestCheckoutTokenSignInE2E(t *testing.T) {
	browser := checkoutBrowser(t)
	s := checkoutStart(t, 0, false, func(c *Config) { c.GuestCheckout = false })
	tab := checkoutTabWithoutGuest(t, browser, s)
	checkoutDo(t, tab, 15*time.Second, "the sign-in section",
		chromedp.Poll[chromedp.Void](`document.body.dataset.state === 'idle' && !document.getElementById('signin').hidden`,
			chromedp.WithPollingTimeout(10*time.Second)))
	text := checkoutPageText(tab)
	if !strings.Contains(text, "Guest checkout is off on this server") || !strings.Contains(text, "orders token --user ID") {
		t.Errorf("the page does not say how to sign in:\n%s", text)
	}
	if !checkoutEval[bool](t, tab, `document.getElementById('place').disabled`) {
		t.Error("the button is enabled with nobody signed in")
	}
	// A bad token is refused on the page.
	checkoutDo(t, tab, 10*time.Second, "a bad token",
		chromedp.SendKeys(chromedp.CSS(`#token-input`), "not-a-token"),
		chromedp.Click(chromedp.CSS(`#token-use`)),
		chromedp.Poll[chromedp.Void](`document.getElementById('signin-status').textContent.includes('not a bearer token')`,
			chromedp.WithPollingTimeout(5*time.Second)))
	checkoutEval[bool](t, tab, `(() => { document.getElementById('token-input').value = ''; return true; })()`)

	checkoutDo(t, tab, 15*time.Second, "signing in with a token",
		chromedp.SendKeys(chromedp.CSS(`#token-input`), token(t, "carol")),
		chromedp.Click(chromedp.CSS(`#token-use`)),
		chromedp.Poll[chromedp.Void](`document.getElementById('signin').hidden && document.getElementById('user').textContent === 'carol' && !document.getElementById('place').disabled`,
			chromedp.WithPollingTimeout(10*time.Second)))
	checkoutDo(t, tab, 10*time.Second, "click", chromedp.Click(chromedp.CSS(`#place`)))
	o := checkoutWaitOutcome(t, tab, 20*time.Second)
	if o.State != "done" || o.Status != "201" || o.User != "carol" || o.Listed != "1" {
		t.Fatalf("outcome: state %q status %q user %q listed %q\npage:\n%s", o.State, o.Status, o.User, o.Listed, o.Text)
	}
	list, _, err := s.srv.backend.repo.List(t.Context(), "carol", 100, "")
	if err != nil || len(list) != 1 || list[0].ID != o.OrderID {
		t.Errorf("carol's orders: %v %+v; want the page's %s", err, list, o.OrderID)
	}

	// A token the API refuses (here: signed with another secret) asks
	// for a new one; no guest is signed in.
	checkoutEval[bool](t, tab, `(() => {
		const s = JSON.parse(sessionStorage.getItem('checkout.session'));
		s.token = s.token.slice(0, -2) + (s.token.endsWith('AA') ? 'BB' : 'AA');
		sessionStorage.setItem('checkout.session', JSON.stringify(s));
		return true;
	})()`)
	checkoutDo(t, tab, 15*time.Second, "reload", chromedp.Reload(),
		chromedp.Poll[chromedp.Void](`document.body.dataset.state === 'idle'`, chromedp.WithPollingTimeout(10*time.Second)))
	checkoutEval[bool](t, tab, `(() => {
		const q = document.getElementById('qty-FILTERS-100');
		q.value = '1';
		q.dispatchEvent(new Event('change'));
		return true;
	})()`)
	checkoutDo(t, tab, 20*time.Second, "a refused token",
		chromedp.Click(chromedp.CSS(`#place`)),
		chromedp.Poll[chromedp.Void](`!document.getElementById('signin').hidden && document.getElementById('user').textContent === 'nobody'`,
			chromedp.WithPollingTimeout(15*time.Second)))
	if txt := checkoutPageText(tab); !strings.Contains(txt, "Your token was refused") || strings.Contains(txt, "Signed in as a new guest") {
		t.Errorf("after a 401 the page should ask for a token and sign in no guest:\n%s", txt)
	}
}

// checkoutTabWithoutGuest opens a new tab and loads the page, without waiting for a
// sign-in.
func checkoutTabWithoutGuest(t *testing.T, browser context.Context, s *checkoutService) context.Context {
	t.Helper()
	tab, cancel := chromedp.NewContext(browser)
	t.Cleanup(cancel)
	if err := chromedp.Do(tab); err != nil {
		t.Fatal(err)
	}
	checkoutDo(t, tab, 20*time.Second, "loading the page", chromedp.Navigate(s.base+"/"))
	return tab
}
