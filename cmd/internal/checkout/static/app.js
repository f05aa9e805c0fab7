// Checkout page of the order service: a demo checkout.
//
// Sign-in: with guest checkout on (orders serve --guest-checkout; the page's
// body says data-guest-checkout="on"), POST /checkout/session makes a new
// guest user and a guest token (valid for 15 minutes, for a few orders),
// kept in sessionStorage: each tab is its own guest and sees only its own
// orders; a refused token (401) signs in again as a new guest. With it off,
// the page shows its sign-in section, where the user pastes a bearer token
// made by `orders token --user ID`; a refused token asks for another.
//
// Idempotency: one checkout attempt is one Idempotency-Key
// (crypto.randomUUID()) and one exact request body. Both are written to
// sessionStorage before the first request and removed only when the attempt
// has a final outcome. Until then every request of the attempt sends the
// same key and the same bytes:
//   - 409 (another request with the key still runs): wait Retry-After, retry;
//   - a network error, a timeout or a 5xx: retry after a bounded backoff;
//   - a second click while the attempt runs: ignored (the button is disabled
//     too), so it never makes a second key;
//   - a reload while a request is in flight: the page finds the attempt in
//     sessionStorage on load and resumes it.
// The server runs the order once per key and replays its answer to every
// retry (Idempotent-Replayed: true), so a customer is charged at most once
// per attempt. Final outcomes: 201 (the order), 402 (declined), 422, and the
// other 4xx (nothing happened). A new attempt, with a new key, starts only
// after a final outcome: the cart is locked while one is pending.
'use strict';

const PRODUCTS = [
  {sku: 'BEANS-250', name: 'Espresso beans, 250 g', price: 1299},
  {sku: 'MUG-CERAMIC', name: 'Ceramic mug', price: 850},
  {sku: 'FILTERS-100', name: 'Paper filters, 100', price: 399},
];
const DEFAULT_CART = {'BEANS-250': 2, 'MUG-CERAMIC': 1, 'FILTERS-100': 0};
const CURRENCY = 'EUR';
const MAX_QUANTITY = 99;
const STORE = {session: 'checkout.session', attempt: 'checkout.attempt', cart: 'checkout.cart', last: 'checkout.last'};

const REQUEST_TIMEOUT_MS = 35000; // above the server's payment timeout (20 s)
const MAX_FAILURES = 8;           // network errors and 5xx in a row before asking the user
const BACKOFF_MS = 500;           // first pause after a failure, doubled up to BACKOFF_MAX_MS
const BACKOFF_MAX_MS = 8000;
const MAX_IN_FLIGHT_MS = 120000;  // how long 409s are waited out before asking the user
const RETRY_AFTER_MAX_S = 30;

const $ = (id) => document.getElementById(id);
const GUEST = document.body.dataset.guestCheckout === 'on';
const money = new Intl.NumberFormat('en-IE', {style: 'currency', currency: CURRENCY});
const fmt = (minor) => money.format(minor / 100);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

let session = null;  // {user_id, token, expires_at, guest}
let cart = {};       // sku -> quantity
let running = false; // the request loop of the pending attempt runs
let placed = false;  // the last attempt made an order and the cart is unchanged since
let last = null;     // {key, outcome} of the last attempt that had a final outcome
const STATUS_TEXT = {201: 'Created', 400: 'Bad Request', 401: 'Unauthorized', 402: 'Payment Required',
  403: 'Forbidden', 409: 'Conflict', 413: 'Content Too Large', 415: 'Unsupported Media Type',
  422: 'Unprocessable Content', 429: 'Too Many Requests'};

function load(k) {
  try { return JSON.parse(sessionStorage.getItem(k)); } catch { return null; }
}
function save(k, v) { sessionStorage.setItem(k, JSON.stringify(v)); }
function pending() { return load(STORE.attempt); }

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === 'class') e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function log(msg) {
  const t = new Date().toLocaleTimeString('en-GB');
  $('log').append(el('li', {}, el('time', {}, t), ' ' + msg));
}

function setStatus(msg) { $('status').textContent = msg; }
function setState(s) { document.body.dataset.state = s; }

// ---- cart ----

function cartItems() {
  return PRODUCTS.filter((p) => cart[p.sku] > 0)
    .map((p) => ({sku: p.sku, quantity: cart[p.sku], unit_price: p.price}));
}

function cartTotal() {
  return cartItems().reduce((sum, i) => sum + i.quantity * i.unit_price, 0);
}

function cartFromBody(body) {
  const c = {};
  for (const p of PRODUCTS) c[p.sku] = 0;
  for (const i of JSON.parse(body).items) c[i.sku] = i.quantity;
  return c;
}

function buildCart() {
  const tbody = $('cart').tBodies[0];
  for (const p of PRODUCTS) {
    const q = el('input', {type: 'number', min: '0', max: String(MAX_QUANTITY), step: '1',
      id: 'qty-' + p.sku, 'aria-label': 'Quantity of ' + p.name});
    q.addEventListener('change', () => {
      let n = Math.trunc(Number(q.value));
      if (!Number.isFinite(n) || n < 0) n = 0;
      cart[p.sku] = Math.min(n, MAX_QUANTITY);
      save(STORE.cart, cart);
      placed = false; // a changed cart is a new checkout attempt
      save(STORE.last, last = null);
      render();
    });
    tbody.append(el('tr', {},
      el('td', {}, p.name, el('br'), el('small', {}, p.sku)),
      el('td', {class: 'num'}, fmt(p.price)),
      el('td', {class: 'num'}, q),
      el('td', {class: 'num', id: 'amount-' + p.sku}, '')));
  }
}

function render() {
  const a = pending();
  for (const p of PRODUCTS) {
    const q = $('qty-' + p.sku);
    q.value = String(cart[p.sku] || 0);
    q.disabled = a !== null || running;
    $('amount-' + p.sku).textContent = fmt((cart[p.sku] || 0) * p.price);
  }
  $('total').textContent = fmt(cartTotal());
  const b = $('place');
  if (running) {
    b.disabled = true;
    b.textContent = 'Placing order…';
  } else if (a) {
    b.disabled = !session;
    b.textContent = 'Retry order (same key)';
  } else {
    b.disabled = !session || placed || cartTotal() === 0;
    b.textContent = placed ? 'Order placed' : 'Place order';
  }
  if (a) $('key').textContent = a.key + (running ? ' (in progress)' : ' (pending: no final outcome yet)');
  else if (last) $('key').textContent = last.key + ' (' + last.outcome + '; the next order gets a new key)';
  else $('key').textContent = 'none yet (made when you place the order)';
}

// ---- sign-in ----

function expired(s) { return Date.parse(s.expires_at) - Date.now() < 60000; }

async function signIn() {
  const res = await fetch('/checkout/session', {method: 'POST', cache: 'no-store'});
  if (res.status === 404) {
    showSignIn('Guest sign-in is not available on this server.');
    throw new Error('guest checkout is off');
  }
  if (res.status === 429) throw new Error('too many sign-ins; wait ' + retryAfterSeconds(res) + ' s');
  if (!res.ok) throw new Error('sign-in answered ' + res.status);
  session = await res.json();
  session.guest = true;
  save(STORE.session, session);
  log('Signed in as a new guest, ' + session.user_id + '.');
}

// signOut forgets the session: a guest signs in again as a new guest,
// anyone else is asked for a token.
async function signOut(why) {
  const guest = session !== null && session.guest;
  sessionStorage.removeItem(STORE.session);
  session = null;
  if (guest && GUEST) {
    await signIn().catch(() => {});
  } else {
    showSignIn(why);
  }
  showUser();
  render();
}

function showSignIn(msg) {
  $('signin').hidden = false;
  $('signin-status').textContent = msg || '';
}

// tokenClaims reads the payload of a JWT (not its signature, which only
// the server can check), or null.
function tokenClaims(token) {
  const parts = token.split('.');
  if (parts.length !== 3) return null;
  try {
    const b64 = parts[1].replace(/-/g, '+').replace(/_/g, '/');
    const c = JSON.parse(atob(b64 + '='.repeat((4 - b64.length % 4) % 4)));
    return c && typeof c === 'object' ? c : null;
  } catch {
    return null;
  }
}

// useToken signs in with the bearer token pasted into the sign-in section.
async function useToken() {
  const token = $('token-input').value.trim().replace(/^Bearer\s+/i, '');
  const c = tokenClaims(token);
  if (!c || typeof c.sub !== 'string' || typeof c.exp !== 'number') {
    showSignIn('That is not a bearer token (a JWT with sub and exp); make one with orders token --user ID.');
    return;
  }
  if (c.exp * 1000 <= Date.now()) {
    showSignIn('That token has expired; make a new one.');
    return;
  }
  session = {user_id: c.sub, token: token, expires_at: new Date(c.exp * 1000).toISOString(), guest: false};
  save(STORE.session, session);
  $('token-input').value = '';
  $('signin').hidden = true;
  log('Signed in with a token as ' + session.user_id + '.');
  showUser();
  render();
  await refreshOrders();
}

function showUser() { $('user').textContent = session ? session.user_id : 'nobody'; }

// ---- placing the order ----

function onPlace() {
  if (running || !session) return; // a second click joins the attempt that runs
  let a = pending();
  if (!a) {
    const items = cartItems();
    if (items.length === 0) return;
    a = {
      key: newKey(),
      body: JSON.stringify({items: items, currency: CURRENCY}),
      user_id: session.user_id,
    };
    save(STORE.attempt, a); // before the first request: a reload resumes it
  }
  run(a);
}

// newKey makes the attempt's Idempotency-Key: crypto.randomUUID(), which
// browsers give only to secure contexts (https, or localhost); on a page
// served over plain http from another host, a version 4 UUID from
// crypto.getRandomValues, which every context has.
function newKey() {
  if (typeof crypto.randomUUID === 'function') return crypto.randomUUID();
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const h = Array.from(b, x => x.toString(16).padStart(2, '0')).join('');
  return h.slice(0, 8) + '-' + h.slice(8, 12) + '-' + h.slice(12, 16) + '-' + h.slice(16, 20) + '-' + h.slice(20);
}

function retryAfterSeconds(res) {
  const v = res.headers.get('Retry-After') || '';
  let s = 1;
  if (/^\d+$/.test(v)) s = Number(v);
  else if (v) {
    const d = Date.parse(v);
    if (!Number.isNaN(d)) s = Math.ceil((d - Date.now()) / 1000);
  }
  return Math.min(Math.max(s, 1), RETRY_AFTER_MAX_S);
}

function backoffMs(failures) {
  const cap = Math.min(BACKOFF_MAX_MS, BACKOFF_MS * 2 ** (failures - 1));
  return Math.round(cap / 2 + Math.random() * cap / 2);
}

function problemOf(text) {
  try {
    const p = JSON.parse(text);
    if (p && typeof p === 'object') return p;
  } catch { /* not JSON */ }
  return {title: 'Unexpected answer', detail: text.slice(0, 200)};
}

// run sends the attempt a until it has a final outcome, or until the
// bounds on retries are reached (then the attempt stays pending and the
// button retries it with the same key).
async function run(a) {
  running = true;
  setState('running');
  $('outcome').hidden = true;
  render();
  let failures = 0;
  let n = 0;
  const inFlightUntil = Date.now() + MAX_IN_FLIGHT_MS;
  try {
    for (;;) {
      n++;
      setStatus(n === 1 ? 'Placing your order…' : 'Placing your order… (try ' + n + ', same key)');
      let res, text;
      const ctl = new AbortController();
      const timer = setTimeout(() => ctl.abort(), REQUEST_TIMEOUT_MS);
      try {
        res = await fetch('/v1/orders', {
          method: 'POST',
          headers: {
            'Content-Type': 'application/json',
            'Authorization': 'Bearer ' + session.token,
            'Idempotency-Key': a.key,
          },
          body: a.body,
          cache: 'no-store',
          signal: ctl.signal,
        });
        text = await res.text();
      } catch (e) {
        failures++;
        const why = e.name === 'AbortError' ? 'no answer in ' + REQUEST_TIMEOUT_MS / 1000 + ' s' : 'network error';
        if (failures >= MAX_FAILURES) {
          log('Try ' + n + ': ' + why + '. Stopped retrying; the order may have been placed.');
          return stopped('The server could not be reached. Your order may have been placed: “Retry order” asks again with the same key, which never charges twice.');
        }
        const d = backoffMs(failures);
        log('Try ' + n + ': ' + why + '; retrying with the same key in ' + (d / 1000).toFixed(1) + ' s.');
        await sleep(d);
        continue;
      } finally {
        clearTimeout(timer);
      }
      const replayed = res.headers.get('Idempotent-Replayed') === 'true';
      if (res.status === 409) {
        const s = retryAfterSeconds(res);
        if (Date.now() + s * 1000 > inFlightUntil) {
          log('Try ' + n + ': 409, the order is still being placed. Stopped waiting.');
          return stopped('Your order is still being placed. “Retry order” asks again with the same key.');
        }
        log('Try ' + n + ': 409 ' + (problemOf(text).title || 'Conflict') + '; retrying with the same key in ' + s + ' s (Retry-After).');
        await sleep(s * 1000);
        continue;
      }
      if (res.status >= 500) {
        failures++;
        const p = problemOf(text);
        if (failures >= MAX_FAILURES) {
          log('Try ' + n + ': ' + res.status + ' ' + (p.title || '') + '. Stopped retrying.');
          return stopped((p.title || 'Server error') + '. Your order may have been placed: “Retry order” asks again with the same key, which never charges twice.');
        }
        const d = res.headers.has('Retry-After') ? Math.max(retryAfterSeconds(res) * 1000, backoffMs(failures)) : backoffMs(failures);
        log('Try ' + n + ': ' + res.status + ' ' + (p.title || '') + '; retrying with the same key in ' + (d / 1000).toFixed(1) + ' s.');
        await sleep(d);
        continue;
      }
      // A final outcome: the attempt is over, the next one gets a new key.
      sessionStorage.removeItem(STORE.attempt);
      delete $('orders').dataset.count; // until the list is fetched again
      last = {key: a.key, outcome: res.status === 201 ? 'order placed' : 'final answer ' + res.status};
      save(STORE.last, last);
      log('Try ' + n + ': ' + res.status + (STATUS_TEXT[res.status] ? ' ' + STATUS_TEXT[res.status] : '') + (replayed ? ', replayed (Idempotent-Replayed: true)' : '') + '.');
      showOutcome(res.status, text, replayed, a.key);
      if (res.status === 401) {
        // The token was refused (expired): a guest signs in again as a new
        // guest, anyone else is asked for a new token.
        await signOut('Your token was refused (' + (problemOf(text).detail || 'expired') + '). Paste a new one.');
      }
      await refreshOrders();
      return;
    }
  } finally {
    running = false;
    render();
  }
}

function stopped(msg) {
  setStatus(msg);
  setState('stopped');
}

function row(dl, name, value) {
  dl.append(el('dt', {}, name), el('dd', {}, value));
}

function showOutcome(status, text, replayed, key) {
  const r = $('result');
  r.replaceChildren();
  delete r.dataset.orderId;
  r.dataset.status = String(status);
  r.dataset.replayed = String(replayed);
  r.className = status === 201 ? 'ok' : 'error';
  if (status === 201) {
    const o = JSON.parse(text);
    placed = true;
    r.dataset.orderId = o.id;
    r.append(el('p', {class: 'headline'}, 'Order placed.'));
    if (replayed) {
      r.append(el('p', {id: 'replayed'}, 'This answer was replayed (Idempotent-Replayed: true): the server had already made this order for this key, so a retry did not charge again.'));
    }
    const dl = el('dl');
    row(dl, 'Order', el('code', {id: 'order-id'}, o.id));
    row(dl, 'Total', el('span', {id: 'order-total'}, fmt(o.total)));
    row(dl, 'Payment', el('code', {id: 'payment-id'}, o.payment_id));
    row(dl, 'Status', o.status);
    row(dl, 'Idempotency-Key', el('code', {}, key));
    r.append(dl);
    setStatus('Order placed. Change the cart to place another order.');
    setState('done');
  } else {
    const p = problemOf(text);
    let headline = p.title || 'Error ' + status;
    if (status === 402) headline = 'Payment declined: no order was made and nothing was charged.';
    r.append(el('p', {class: 'headline'}, headline));
    if (p.detail) r.append(el('p', {id: 'problem-detail'}, p.detail));
    if (replayed) r.append(el('p', {id: 'replayed'}, 'This answer was replayed (Idempotent-Replayed: true).'));
    r.append(el('p', {class: 'hint'}, 'Status ' + status + (p.type ? ', ' + p.type : '') + '. Placing the order again starts a new attempt with a new key.'));
    setStatus(headline);
    setState('error');
  }
  $('outcome').hidden = false;
}

// ---- the user's orders ----

async function refreshOrders() {
  const tbody = $('orders').tBodies[0];
  if (!session) return;
  try {
    const res = await fetch('/v1/orders', {headers: {'Authorization': 'Bearer ' + session.token}, cache: 'no-store'});
    const text = await res.text();
    if (!res.ok) {
      $('orders-note').textContent = 'Could not list your orders: ' + (problemOf(text).title || res.status) + '.';
      return;
    }
    const list = JSON.parse(text).orders;
    tbody.replaceChildren(...list.map((o) => el('tr', {'data-order-id': o.id},
      el('td', {}, el('code', {}, o.id)),
      el('td', {}, new Date(o.created_at).toLocaleString('en-GB', {dateStyle: 'short', timeStyle: 'short'})),
      el('td', {class: 'num'}, fmt(o.total)),
      el('td', {}, el('code', {}, o.payment_id)))));
    $('orders').dataset.count = String(list.length);
    $('orders-note').textContent = list.length === 0 ? 'No orders yet.' : list.length === 1 ? 'One order.' : list.length + ' orders.';
  } catch {
    $('orders-note').textContent = 'Could not list your orders (network error).';
  }
}

// ---- start ----

async function init() {
  buildCart();
  const a = pending();
  // A pending attempt locks the cart to the body it sends.
  cart = a ? cartFromBody(a.body) : (load(STORE.cart) || {...DEFAULT_CART});
  session = load(STORE.session);
  last = a ? null : load(STORE.last);
  placed = last !== null && last.outcome === 'order placed';
  $('place').addEventListener('click', onPlace);
  $('token-use').addEventListener('click', useToken);
  if (session && session.guest && !GUEST) session = null; // guest checkout was turned off
  if (!session || (!a && expired(session))) {
    session = null;
    if (GUEST) {
      try {
        await signIn();
      } catch (e) {
        setStatus('Could not sign in (' + e.message + '). Reload the page to try again.');
      }
    } else {
      showSignIn('');
    }
  }
  showUser();
  render();
  setState('idle');
  if (a && session) {
    log('Resuming the pending checkout attempt (same key, same body).');
    run(a);
  }
  refreshOrders();
}

init();
