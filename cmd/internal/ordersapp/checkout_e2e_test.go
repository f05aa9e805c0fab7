package ordersapp

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/idem-go/idem/cmd/internal/checkout"
	"github.com/idem-go/idem/cmd/internal/payments"
)

// The checkout page (cmd/internal/checkout) driven by a headless Chromium:
// whatever the clicks, drops and reloads, one checkout attempt makes one
// order and one payment, checked in the order repository and the
// in-process gateway's ledger.

const checkoutChromium = "/usr/bin/chromium"

// checkoutPost is one POST /v1/orders as the service saw it, with the answer's
// status and body when the answer was sent (0 and "" when it was dropped).
type checkoutPost struct {
	key, body string
	status    int
	answer    string
}

// checkoutTee passes an answer on and keeps a copy of its status and body.
type checkoutTee struct {
	http.ResponseWriter
	status int
	body   strings.Builder
}

func (w *checkoutTee) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *checkoutTee) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	w.body.Write(b)
	return w.ResponseWriter.Write(b)
}

func (w *checkoutTee) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// checkoutService is an in-process order service (SQLite, in-process gateway)
// whose handler is wrapped to record every POST /v1/orders and, when
// dropFirst is set, to drop the answer of the first one after it ran.
type checkoutService struct {
	srv       *server
	base      string
	logs      *syncBuffer
	payKey    string
	dropFirst bool

	mu      sync.Mutex
	posts   []checkoutPost
	dropped int // status of the answer dropped, 0 if none
	// answered, if set (under mu), is called with the index of each
	// POST /v1/orders answered and the answer's status.
	answered func(i, status int)
}

// checkoutStart starts the service, with guest checkout on; opts adjust its
// Config before it starts.
func checkoutStart(t *testing.T, latency time.Duration, dropFirst bool, opts ...func(*Config)) *checkoutService {
	t.Helper()
	// The page signs in as a guest: guest checkout is on unless opts turn
	// it off.
	c := &Config{DataDir: t.TempDir(), JWTSecret: testSecret, KeyTTL: 24 * time.Hour, KeyLease: 30 * time.Second,
		RequireKey: true, PaymentsKey: "sk_test_checkout", gatewayLatency: latency, GuestCheckout: true}
	for _, o := range opts {
		o(c)
	}
	s := &checkoutService{logs: new(syncBuffer), payKey: c.PaymentsKey, dropFirst: dropFirst}
	ctx, cancel := context.WithCancel(context.Background())
	srv, err := (&App{}).newServer(ctx, c, slog.New(slog.NewTextHandler(s.logs, nil)))
	if err != nil {
		cancel()
		t.Fatalf("newServer: %v", err)
	}
	s.srv = srv
	api := srv.handler
	srv.handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.serve(api, w, r) })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		cancel()
		srv.close()
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.run(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("server: %v", err)
		}
		srv.close()
		if t.Failed() {
			t.Logf("server logs (last lines):\n%s", tail(s.logs.String(), 40))
		}
	})
	s.base = "http://" + ln.Addr().String()
	return s
}

func (s *checkoutService) serve(api http.Handler, w http.ResponseWriter, r *http.Request) {
	if s.dropFirst {
		// Every request on a connection of its own: Chromium resends a
		// request by itself, unseen by the page, when a connection it
		// reused closes before the answer (the server may have closed
		// it while idle); the drop must reach the page's fetch.
		w.Header().Set("Connection", "close")
	}
	if r.Method != http.MethodPost || r.URL.Path != "/v1/orders" {
		api.ServeHTTP(w, r)
		return
	}
	b, err := io.ReadAll(r.Body)
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	r.Body = io.NopCloser(strings.NewReader(string(b)))
	s.mu.Lock()
	s.posts = append(s.posts, checkoutPost{key: r.Header.Get("Idempotency-Key"), body: string(b)})
	i := len(s.posts) - 1
	first := i == 0
	s.mu.Unlock()
	if first && s.dropFirst {
		// The order is made and committed, then the connection is cut
		// before a byte of the answer is sent.
		rec := httptest.NewRecorder()
		api.ServeHTTP(rec, r)
		s.mu.Lock()
		s.dropped = rec.Code
		s.mu.Unlock()
		panic(http.ErrAbortHandler)
	}
	tee := &checkoutTee{ResponseWriter: w}
	api.ServeHTTP(tee, r)
	s.mu.Lock()
	s.posts[i].status, s.posts[i].answer = tee.status, tee.body.String()
	answered := s.answered
	s.mu.Unlock()
	if answered != nil {
		answered(i, tee.status)
	}
}

func (s *checkoutService) postsSeen() []checkoutPost {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]checkoutPost(nil), s.posts...)
}

// checkoutBrowser starts a headless Chromium for the test, or skips (fails
// when CI=true) when there is none.
func checkoutBrowser(t *testing.T) context.Context {
	t.Helper()
	skipInShort(t, "drives Chromium")
	if _, err := os.Stat(checkoutChromium); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s is missing (CI=true): install Debian's chromium package (.ci/run does)", checkoutChromium)
		}
		t.Skipf("%s is missing: install Debian's chromium package to run the checkout page's browser test", checkoutChromium)
	}
	dir := t.TempDir()
	// The whole browser lives at most this long, whatever a step does.
	life, stop := context.WithTimeout(context.Background(), 4*time.Minute)
	alloc, cancelAlloc := chromedp.NewExecAllocator(life,
		chromedp.ExecPath(checkoutChromium),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.UserDataDir(dir),
		chromedp.WindowSize(900, 1200),
	)
	browser, cancelBrowser := chromedp.NewContext(alloc)
	t.Cleanup(func() {
		cancelBrowser()
		cancelAlloc()
		stop()
	})
	if err := chromedp.Do(browser); err != nil {
		t.Fatalf("starting %s: %v", checkoutChromium, err)
	}
	return browser
}

// checkoutTab opens a new tab (its own sessionStorage, so its own guest) and
// loads the page.
func checkoutTab(t *testing.T, browser context.Context, s *checkoutService) context.Context {
	t.Helper()
	tab, cancel := chromedp.NewContext(browser)
	t.Cleanup(cancel)
	if err := chromedp.Do(tab); err != nil {
		t.Fatal(err)
	}
	checkoutDo(t, tab, 20*time.Second, "loading the page",
		chromedp.Navigate(s.base+"/"),
		chromedp.Poll[chromedp.Void](`document.body.dataset.state !== undefined && !document.getElementById('place').disabled`, chromedp.WithPollingTimeout(15*time.Second)),
	)
	return tab
}

// checkoutDo runs steps on tab within d.
func checkoutDo(t *testing.T, tab context.Context, d time.Duration, what string, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(tab, d)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		t.Fatalf("%s: %v\npage: %s", what, err, checkoutPageText(tab))
	}
}

func checkoutEval[T any](t *testing.T, tab context.Context, expr string) T {
	t.Helper()
	ctx, cancel := context.WithTimeout(tab, 10*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](expr))
	if err != nil {
		t.Fatalf("evaluating %s: %v", expr, err)
	}
	return v
}

// checkoutPageText is the page's visible text, for failure messages.
func checkoutPageText(tab context.Context) string {
	ctx, cancel := context.WithTimeout(tab, 5*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body.innerText`))
	if err != nil {
		return "(" + err.Error() + ")"
	}
	return s
}

// checkoutOutcome waits for the attempt's final outcome on the page.
type checkoutOutcome struct {
	State    string `json:"state"`
	Status   string `json:"status"`
	Replayed string `json:"replayed"`
	OrderID  string `json:"orderId"`
	Payment  string `json:"payment"`
	Total    string `json:"total"`
	User     string `json:"user"`
	Log      string `json:"log"`
	Text     string `json:"text"`
	Pending  bool   `json:"pending"`
	Listed   string `json:"listed"`
}

func checkoutWaitOutcome(t *testing.T, tab context.Context, d time.Duration) checkoutOutcome {
	t.Helper()
	checkoutDo(t, tab, d+5*time.Second, "waiting for the order's outcome",
		chromedp.Poll[chromedp.Void](`['done', 'error', 'stopped'].includes(document.body.dataset.state) && document.getElementById('orders').dataset.count !== undefined`,
			chromedp.WithPollingTimeout(d), chromedp.WithPollingInterval(50*time.Millisecond)))
	return checkoutEval[checkoutOutcome](t, tab, `(() => {
		const r = document.getElementById('result');
		const txt = (id) => { const e = document.getElementById(id); return e ? e.textContent : ''; };
		return {
			state: document.body.dataset.state, status: r.dataset.status || '', replayed: r.dataset.replayed || '',
			orderId: r.dataset.orderId || '', payment: txt('payment-id'), total: txt('order-total'),
			user: txt('user'), log: document.getElementById('log').innerText, text: document.body.innerText,
			pending: sessionStorage.getItem('checkout.attempt') !== null,
			listed: document.getElementById('orders').dataset.count,
		};
	})()`)
}

// checkoutCheckOne checks, in the repository and the gateway's ledger, that
// the page's user has exactly one order, paid by exactly one payment, and
// that the page shows it; and that every POST /v1/orders carried one
// key (a UUID) and one body.
func checkoutCheckOne(t *testing.T, s *checkoutService, o checkoutOutcome) {
	t.Helper()
	t.Logf("page's requests:\n%s", o.Log)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if !strings.HasPrefix(o.User, "guest-") {
		t.Fatalf("page shows user %q, want a guest", o.User)
	}
	list, _, err := s.srv.backend.repo.List(ctx, o.User, 100, "")
	if err != nil {
		t.Fatal(err)
	}
	pis, err := payments.ListAll(ctx, s.srv.ledger, payments.AccountFor(s.payKey))
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || len(pis) != 1 {
		t.Fatalf("%d orders of %s and %d payments in the ledger; want one each\npage:\n%s", len(list), o.User, len(pis), o.Text)
	}
	ord, pi := list[0], pis[0]
	if pi.Status != "succeeded" || pi.ID != ord.PaymentID || pi.Metadata["order_ref"] != ord.ID || pi.Amount != ord.Total {
		t.Errorf("payment %s %s of %d for %q; want succeeded, %s, %d for %s", pi.ID, pi.Status, pi.Amount, pi.Metadata["order_ref"], ord.PaymentID, ord.Total, ord.ID)
	}
	if o.State != "done" || o.Status != "201" || o.OrderID != ord.ID || o.Payment != ord.PaymentID || o.Pending || o.Listed != "1" {
		t.Errorf("page: state %q, status %q, order %q, payment %q, attempt still pending %v, %q orders listed; want done, 201, %s, %s, false, 1\npage:\n%s",
			o.State, o.Status, o.OrderID, o.Payment, o.Pending, o.Listed, ord.ID, ord.PaymentID, o.Text)
	}
	uuid := regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	posts := s.postsSeen()
	if len(posts) == 0 {
		t.Fatal("no POST /v1/orders reached the service")
	}
	for i, p := range posts {
		if !uuid.MatchString(p.key) || p.key != posts[0].key || p.body != posts[0].body {
			t.Errorf("POST %d: key %q body %s; want the first's, a UUID v4: %q %s", i+1, p.key, p.body, posts[0].key, posts[0].body)
		}
	}
	var body struct {
		Items []struct {
			SKU       string `json:"sku"`
			Quantity  int64  `json:"quantity"`
			UnitPrice int64  `json:"unit_price"`
		} `json:"items"`
	}
	if err := json.Unmarshal([]byte(posts[0].body), &body); err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, it := range body.Items {
		total += it.Quantity * it.UnitPrice
	}
	if ord.Total != total || ord.Currency != "EUR" {
		t.Errorf("order total %d %s, want %d EUR (the page's cart)", ord.Total, ord.Currency, total)
	}
}

// TestCheckoutE2E drives the checkout page in Chromium through a double
// click, an answer lost after the order committed, and a reload while the
// payment runs; each ends with one order and one payment. Then a changed
// cart after an order is a new attempt with a new key. With
// CHECKOUT_SCREENSHOT=<path> it saves a PNG of the page after the first
// order there.
func TestCheckoutE2E(t *testing.T) {
	browser := checkoutBrowser(t)

	t.Run("double click", func(t *testing.T) {
		s := checkoutStart(t, 300*time.Millisecond, false)
		tab := checkoutTab(t, browser, s)
		// Two clicks back to back, in one task: the second finds the
		// attempt running and neither makes a key nor sends anything.
		checkoutEval[bool](t, tab, `(() => {
			const b = document.getElementById('place');
			b.dispatchEvent(new MouseEvent('click', {bubbles: true}));
			b.dispatchEvent(new MouseEvent('click', {bubbles: true}));
			return true;
		})()`)
		o := checkoutWaitOutcome(t, tab, 20*time.Second)
		checkoutCheckOne(t, s, o)
		if n := len(s.postsSeen()); n != 1 || o.Replayed != "false" {
			t.Errorf("%d POST /v1/orders, replayed %q; want 1, false\nlog: %s", n, o.Replayed, o.Log)
		}
		// A real double click on the button now (the order is placed and
		// the cart unchanged) does nothing either.
		checkoutDo(t, tab, 10*time.Second, "double click", chromedp.DoubleClick(chromedp.CSS(`#place`)))
		o = checkoutWaitOutcome(t, tab, 5*time.Second)
		checkoutCheckOne(t, s, o)
		if path := os.Getenv("CHECKOUT_SCREENSHOT"); path != "" {
			ctx, cancel := context.WithTimeout(tab, 15*time.Second)
			png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
			cancel()
			if err != nil {
				t.Fatalf("screenshot: %v", err)
			}
			if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, png, 0o644); err != nil {
				t.Fatal(err)
			}
			t.Logf("wrote %s (%d bytes)", path, len(png))
		}
	})

	t.Run("answer lost after commit", func(t *testing.T) {
		s := checkoutStart(t, 0, true)
		tab := checkoutTab(t, browser, s)
		checkoutDo(t, tab, 10*time.Second, "click", chromedp.Click(chromedp.CSS(`#place`)))
		o := checkoutWaitOutcome(t, tab, 30*time.Second)
		checkoutCheckOne(t, s, o)
		s.mu.Lock()
		dropped := s.dropped
		s.mu.Unlock()
		if dropped != http.StatusCreated {
			t.Errorf("the dropped answer was %d, want 201 (the order committed)", dropped)
		}
		if n := len(s.postsSeen()); n < 2 || o.Replayed != "true" || !strings.Contains(o.Log, "network error; retrying with the same key") || !strings.Contains(o.Text, "replayed") {
			t.Errorf("%d POST /v1/orders, replayed %q; want 2 or more, the page retrying after a network error and showing the replay\nlog: %s", n, o.Replayed, o.Log)
		}
	})

	t.Run("reload during payment", func(t *testing.T) {
		// The page reloads once the payment is being made, and the payment
		// is held until the reloaded page's resumed POST has had its 409,
		// or for 30 s at most. (With a fixed 3 s payment and a reload as
		// soon as the POST arrived, a loaded machine could let the payment
		// end before the resumed POST, or the reload cancel the POST
		// before it claimed its key: no 409 either way.)
		charging, resumed := make(chan struct{}), make(chan struct{})
		var chargingOnce, resumedOnce sync.Once
		t.Cleanup(func() { resumedOnce.Do(func() { close(resumed) }) })
		s := checkoutStart(t, 0, false, func(c *Config) {
			c.gatewayHold = func() {
				chargingOnce.Do(func() { close(charging) })
				select {
				case <-resumed:
				case <-time.After(30 * time.Second):
				}
			}
		})
		s.mu.Lock()
		s.answered = func(i, status int) {
			if i > 0 && status == http.StatusConflict {
				resumedOnce.Do(func() { close(resumed) })
			}
		}
		s.mu.Unlock()
		tab := checkoutTab(t, browser, s)
		checkoutDo(t, tab, 10*time.Second, "click", chromedp.Click(chromedp.CSS(`#place`)))
		select {
		case <-charging:
		case <-time.After(10 * time.Second):
			t.Fatalf("no payment within 10s\npage: %s", checkoutPageText(tab))
		}
		key := checkoutEval[string](t, tab, `JSON.parse(sessionStorage.getItem('checkout.attempt')).key`)
		// The reload comes while the payment is held.
		checkoutDo(t, tab, 10*time.Second, "reload", chromedp.Reload())
		o := checkoutWaitOutcome(t, tab, 30*time.Second)
		checkoutCheckOne(t, s, o)
		posts := s.postsSeen()
		if posts[0].key != key || len(posts) < 3 || o.Replayed != "true" ||
			!strings.Contains(o.Log, "Resuming the pending checkout attempt") || !strings.Contains(o.Log, "409") {
			t.Errorf("%d POST /v1/orders (key %q, the page's %q), replayed %q; want the resumed attempt's 409, its retry after Retry-After and the replay\nlog: %s",
				len(posts), posts[0].key, key, o.Replayed, o.Log)
		}
	})

	t.Run("changed cart after an order", func(t *testing.T) {
		s := checkoutStart(t, 0, false)
		tab := checkoutTab(t, browser, s)
		checkoutDo(t, tab, 10*time.Second, "click", chromedp.Click(chromedp.CSS(`#place`)))
		checkoutCheckOne(t, s, checkoutWaitOutcome(t, tab, 20*time.Second))
		// After the final outcome the button waits for a changed cart; the
		// next attempt has a new key and the new body.
		if !checkoutEval[bool](t, tab, `document.getElementById('place').disabled`) {
			t.Error("the button is enabled after the order, with the cart unchanged")
		}
		checkoutEval[bool](t, tab, `(() => {
			const q = document.getElementById('qty-FILTERS-100');
			q.value = '3';
			q.dispatchEvent(new Event('change'));
			return true;
		})()`)
		checkoutDo(t, tab, 20*time.Second, "placing a second order",
			chromedp.Click(chromedp.CSS(`#place`)),
			chromedp.Poll[chromedp.Void](`document.body.dataset.state === 'done' && document.getElementById('orders').dataset.count === '2'`,
				chromedp.WithPollingTimeout(15*time.Second), chromedp.WithPollingInterval(50*time.Millisecond)))
		user := checkoutEval[string](t, tab, `document.getElementById('user').textContent`)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		list, _, err := s.srv.backend.repo.List(ctx, user, 100, "")
		if err != nil {
			t.Fatal(err)
		}
		pis, err := payments.ListAll(ctx, s.srv.ledger, payments.AccountFor(s.payKey))
		if err != nil {
			t.Fatal(err)
		}
		posts := s.postsSeen()
		if len(list) != 2 || len(pis) != 2 || len(posts) != 2 || posts[0].key == posts[1].key ||
			!strings.Contains(posts[1].body, `{"sku":"FILTERS-100","quantity":3,"unit_price":399}`) || strings.Contains(posts[0].body, "FILTERS-100") {
			t.Errorf("%d orders, %d payments, POSTs %+v; want two of each, the second with a new key and the changed cart", len(list), len(pis), posts)
		}
	})
}

// TestCheckoutSessionTokenAccepted: the page's sign-in gives a token that the
// API accepts (the new guest has no orders), and the page and its errors
// are served through `orders serve`'s handler.
func TestCheckoutSessionTokenAccepted(t *testing.T) {
	s := checkoutStart(t, 0, false)
	hc := &http.Client{Timeout: 10 * time.Second}
	do := func(method, path, tok string) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequest(method, s.base+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		if tok != "" {
			req.Header.Set("Authorization", "Bearer "+tok)
		}
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp, string(b)
	}
	resp, body := do(http.MethodPost, "/checkout/session", "")
	var sess checkout.Session
	if err := json.Unmarshal([]byte(body), &sess); resp.StatusCode != http.StatusCreated || err != nil {
		t.Fatalf("POST /checkout/session: %d %v %s", resp.StatusCode, err, body)
	}
	resp, body = do(http.MethodGet, "/v1/orders", sess.Token)
	if resp.StatusCode != http.StatusOK || strings.TrimSpace(body) != `{"orders":[],"has_more":false}` {
		t.Errorf("GET /v1/orders with the guest's token: %d %s; want 200 and no orders", resp.StatusCode, body)
	}
	resp, body = do(http.MethodGet, "/v1/orders", sess.Token+"x")
	if resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("a spoiled token: %d %s, want 401", resp.StatusCode, body)
	}
	for _, c := range []struct {
		method, path string
		status       int
		ct           string
	}{
		{http.MethodGet, "/", http.StatusOK, "text/html; charset=utf-8"},
		{http.MethodGet, "/checkout/app.js", http.StatusOK, "text/javascript; charset=utf-8"},
		{http.MethodGet, "/checkout/style.css", http.StatusOK, "text/css; charset=utf-8"},
		{http.MethodGet, "/checkout/missing.png", http.StatusNotFound, "application/problem+json"},
		{http.MethodPost, "/", http.StatusMethodNotAllowed, "application/problem+json"},
		{http.MethodGet, "/checkout/session", http.StatusMethodNotAllowed, "application/problem+json"},
	} {
		resp, body := do(c.method, c.path, "")
		if resp.StatusCode != c.status || resp.Header.Get("Content-Type") != c.ct {
			t.Errorf("%s %s: %d %q, want %d %q\n%s", c.method, c.path, resp.StatusCode, resp.Header.Get("Content-Type"), c.status, c.ct, body)
		}
	}
}
