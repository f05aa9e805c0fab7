package ordersapp

// Regression tests from the second adversarial review of issue 8 (attacks
// on the whole protocol). Each failed on the main of that day and states a
// rule of CONTRACT.md.

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/problem"
)

// pgExec runs statements on dbURL.
func pgExec(t *testing.T, dbURL string, stmts ...string) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	for _, s := range stmts {
		if _, err := conn.Exec(ctx, s); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
	}
}

// blipTrigger makes every INSERT into orders fail with a transient error
// (40001, serialization failure: not a refusal for good) while the table
// review_blip holds a row.
var blipTrigger = []string{
	`CREATE TABLE review_blip (on_ boolean)`,
	`INSERT INTO review_blip VALUES (true)`,
	`CREATE FUNCTION review_blip() RETURNS trigger LANGUAGE plpgsql AS $$
	BEGIN
		IF EXISTS (SELECT 1 FROM review_blip) THEN
			RAISE EXCEPTION 'review: transient blip' USING ERRCODE = '40001';
		END IF;
		RETURN NEW;
	END $$`,
	`CREATE TRIGGER review_blip BEFORE INSERT ON orders FOR EACH ROW EXECUTE FUNCTION review_blip()`,
}

// Finding 1 (TestUnansweredOrderPaysOnceAfterGatewayForgetsKey) is fixed and
// moved to retention_test.go.

var _ = strings.Contains
var _ = payments.DefaultSchema

// serveOnPG migrates a fresh database, runs setup on it, and starts orders
// serve on it with the in-process gateway and extra flags; it returns the
// database URL, the data dir and the base URL.
func serveOnPG(t *testing.T, setup []string, flags ...string) (db, dir, base string) {
	t.Helper()
	return serveOnPGURL(t, setup, func(db string) string { return db }, flags...)
}

// serveOnPGURL is serveOnPG with serve given serveURL(db) as its
// --database-url (db with a session setting of its own, say); the
// migration and setup run on db itself.
func serveOnPGURL(t *testing.T, setup []string, serveURL func(db string) string, flags ...string) (db, dir, base string) {
	t.Helper()
	ordersBin, _ := binaries(t)
	db = pgtest.Database(t)
	dir = t.TempDir()
	if code, out, errs := run(t, nil, "migrate", "--database-url", db, "--data-dir", dir); code != 0 {
		t.Fatalf("migrate: %d %s %s", code, out, errs)
	}
	pgExec(t, db, setup...)
	addr := freeAddr(t)
	start(t, "http://"+addr+"/healthz", ordersBin, append([]string{"serve", "--addr", addr, "--data-dir", dir, "--database-url", serveURL(db),
		"--jwt-secret", testSecret}, flags...)...)
	return db, dir, "http://" + addr
}

// keyStatus returns the stored status of (user, key) (0: none yet) and its
// attempts.
func keyStatus(t *testing.T, db, user, key string) (status, attempts int) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if err := conn.QueryRow(ctx, `SELECT coalesce(response_status, 0), attempts FROM public.idempotency_keys WHERE user_id = $1 AND key = $2`, user, key).Scan(&status, &attempts); err != nil {
		t.Fatal(err)
	}
	return status, attempts
}

// TestCompleterStoresOrderNotWritable checks that the completer of serve
// stores the final 422 order-not-writable that a re-drive answers after
// refunding.
//
// Finding 4. serve gives the completer s.ordersCfg.IdemOptions, whose
// Stored is nil (orders.NewHandler fills it in its own copy only), so the
// completer's middleware uses idem.StoredStatus: the 422
// order-not-writable that a re-drive answers, after refunding, is not
// stored. The key stays without an answer; the completer re-drives it
// again and again (each time through the gateway) until it gives up, and
// the key ends "given up" although its outcome was final.
//
// The first attempt pays and fails with a transient error (503); then the
// database refuses the order for good (a CHECK-like 23514). Nobody
// retries: the completer alone finishes the key.
func TestCompleterStoresOrderNotWritable(t *testing.T) {
	setup := append(append([]string{}, blipTrigger[:3]...),
		`CREATE FUNCTION review_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.items::text LIKE '%REFUSED%' THEN
				RAISE EXCEPTION 'review: refused for good' USING ERRCODE = '23514';
			END IF;
			RETURN NEW;
		END $$`,
		`CREATE TRIGGER review_a_blip BEFORE INSERT ON orders FOR EACH ROW EXECUTE FUNCTION review_blip()`,
		`CREATE TRIGGER review_b_refuse BEFORE INSERT ON orders FOR EACH ROW EXECUTE FUNCTION review_refuse()`,
	)
	db, _, base := serveOnPG(t, setup, "--key-lease", "2s")
	body := `{"items":[{"sku":"REFUSED","quantity":1,"unit_price":1000}],"currency":"EUR"}`
	if s, b := postBody(t, base, "nobody-retries", "k-422", body); s != http.StatusServiceUnavailable {
		t.Fatalf("first attempt: %d %s; want 503", s, b)
	}
	pgExec(t, db, `DELETE FROM review_blip`)
	var status, attempts int
	for deadline := time.Now().Add(12 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) { // a poll with a deadline
		if status, attempts = keyStatus(t, db, "nobody-retries", "k-422"); status != 0 {
			break
		}
	}
	refunds := countRows(t, db, `SELECT count(*) FROM payments.refunds`)
	if status != http.StatusUnprocessableEntity {
		t.Errorf("after the completer re-drove the key (%d attempts, %d refunds): stored status %d, want 422 order-not-writable stored (it is final)", attempts, refunds, status)
	}
}

// TestClientRetriesLeaveCompleterBudget checks that a client's quick
// retries through a short outage do not spend the completer's budget: the
// completer still re-drives the key and the order is made.
//
// Finding 5. The completer's MaxAttempts (20) counts the client's own
// attempts. A client that retries quickly through a short outage of the
// orders table (client.Transport retries 503 with Retry-After) spends
// them all, gives up, and the completer never re-drives the key: the
// payment made by the first attempt stays without its order for good,
// though the database is back a moment later. Invariant 2 ("no payment is
// left without its order once the completer has run, whether or not the
// client retried") is broken, and the audit says so.
func TestClientRetriesLeaveCompleterBudget(t *testing.T) {
	db, dir, base := serveOnPG(t, blipTrigger, "--key-lease", "2s")
	body := `{"items":[{"sku":"SKU-1","quantity":1,"unit_price":1000}],"currency":"EUR"}`
	// Each attempt during the outage fails with 503 and leaves the key
	// retryable. Between two attempts the completer may take the key up
	// itself (its re-drive fails the same way): an attempt that meets it
	// is answered 409 in flight, which is as good a refusal. On a loaded
	// machine, where 20 attempts take longer than a lease, that happens.
	inFlight := 0
	for i := 0; i < 20; i++ {
		s, b := postBody(t, base, "impatient", "k-20", body)
		switch {
		case s == http.StatusServiceUnavailable:
		case i > 0 && s == http.StatusConflict && strings.Contains(b, problem.InFlight):
			inFlight++
		default:
			t.Fatalf("attempt %d during the outage: %d %s; want 503 (or, after the first, 409 in flight)", i+1, s, b)
		}
	}
	if inFlight > 0 {
		t.Logf("%d of the 20 attempts during the outage met the completer's re-drive (409 in flight)", inFlight)
	}
	pgExec(t, db, `DELETE FROM review_blip`) // the outage is over; the client gave up
	var status, attempts int
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) { // a poll with a deadline
		if status, attempts = keyStatus(t, db, "impatient", "k-20"); status != 0 {
			break
		}
	}
	if status != http.StatusCreated {
		t.Errorf("10 s after the outage: key stored %d after %d attempts, want 201: the completer never re-drove it (the client's attempts used its budget)", status, attempts)
		code, out, errs := run(t, nil, "audit", "--database-url", db, "--data-dir", dir)
		t.Logf("audit: exit %d\n%s%s", code, out, errs)
	}
}

// TestServeCompleterStoresUnwritableOutcome checks that serve's completer
// stores what the order route stores (orders.StoredStatus): an abandoned
// order refused for good ends with its 422 stored.
//
// It guards a bug found in the second review of issue 8, as it was found: orders.StoredStatus
// (2xx, 3xx, 402 and the handler's 422 order-not-writable) is what the
// route stores, and orders' own doc says to give it to the completer too;
// serve builds the completer from its own IdemOptions, whose Stored is nil,
// so the completer's middleware stores only idem.StoredStatus. An
// abandoned order whose row the database refuses for good is re-driven:
// paid (replayed), refused, refunded, answered 422, and the 422 is not
// stored: the key stays without an outcome, is re-driven again and again
// (each time through the gateway) until the completer gives up, and stays
// bound, unanswered and never expiring, to be re-run by any later retry
// (after the gateway forgot its keys, a new charge and a new refund).
func TestServeCompleterStoresUnwritableOutcome(t *testing.T) {
	ctx := context.Background()
	db := pgtest.Database(t)
	c := Config{DataDir: t.TempDir(), DatabaseURL: db, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: 30 * time.Second,
		PaymentsKey: "sk_test_local", RequireKey: true}
	srv, err := (&App{}).newServer(ctx, &c, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close()
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	// A refusal no validation foresees (as in cmd/internal/orders' tests).
	if _, err := pool.Exec(ctx, `ALTER TABLE orders ADD CONSTRAINT test_refused_sku CHECK (NOT items @> '[{"sku":"REFUSED"}]')`); err != nil {
		t.Fatal(err)
	}
	body := `{"items":[{"sku":"REFUSED","quantity":1,"unit_price":500}],"currency":"EUR"}`
	fp, err := idem.FingerprintWithoutQuery(httptest.NewRequest("POST", "/v1/orders", nil), []byte(body)) // the order API's fingerprint
	if err != nil {
		t.Fatal(err)
	}
	// An attempt whose instance died after the claim.
	if _, err := srv.backend.store.Claim(ctx, idemdriver.ClaimParams{
		User: "alice", Key: "unwritable-1", Fingerprint: fp, Owner: idemdriver.NewOwner(),
		Method: "POST", Path: "/v1/orders", Header: http.Header{"Content-Type": {"application/json"}},
		Body: []byte(body), Lease: 50 * time.Millisecond, TTL: time.Hour,
	}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // not waiting for an outcome: PostgreSQL's clock (serve's store reads it) passes the 50ms lease
	st, err := srv.completer.RunOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := srv.backend.store.Get(ctx, "alice", "unwritable-1")
	if err != nil {
		t.Fatal(err)
	}
	if rec.Response == nil || rec.Response.Status != http.StatusUnprocessableEntity {
		t.Errorf("after the completer (%+v): stored response %+v, attempts %d; want the final 422 order-not-writable stored, "+
			"as the route stores it", st, rec.Response, rec.Attempts)
	}
}
