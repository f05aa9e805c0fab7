package ordersapp

// Regression tests from the second adversarial review of issue 8 (attacks
// on the whole protocol). Each failed on the main of that day and states a
// rule of CONTRACT.md.

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/internal/pgtest"
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

// Finding 1 (TestReviewGatewayForgetsKeyOfUnansweredOrder) is fixed and
// moved to retention_test.go.

// Finding 2. Issue 8 point 7 asks serve to refuse a --key-ttl above an
// external gateway's retention (24 h, as at Stripe): an order key retried
// after the gateway forgot its payment key pays a second time. serve
// accepts --key-ttl 48h with --payments-url (and through ORDERS_KEY_TTL),
// and starts.
func TestReviewKeyTTLAboveExternalRetentionRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		args []string
	}{
		{"flag", nil, []string{"--key-ttl", "48h"}},
		{"env", map[string]string{"ORDERS_KEY_TTL": "48h"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			var out, errb syncBuffer
			a := &App{Stdout: &out, Stderr: &errb, Getenv: func(k string) string { return tc.env[k] }}
			args := append([]string{"serve", "--addr", freeAddr(t), "--data-dir", dir, "--jwt-secret", testSecret,
				"--payments-url", "http://127.0.0.1:1"}, tc.args...)
			code := a.Run(ctx, args)
			if code != 2 {
				t.Errorf("serve --payments-url … with a key TTL of 48h: exit %d, want 2 (a TTL above the external gateway's 24h retention)\n%s", code, errb.String())
			}
		})
	}
}

var _ = strings.Contains
var _ = payments.DefaultSchema

// serveOnPG migrates a fresh database, runs setup on it, and starts orders
// serve on it with the in-process gateway and extra flags; it returns the
// database URL, the data dir and the base URL.
func serveOnPG(t *testing.T, setup []string, flags ...string) (db, dir, base string) {
	t.Helper()
	ordersBin, _ := binaries(t)
	db = pgtest.Database(t)
	dir = t.TempDir()
	if code, out, errs := run(t, nil, "migrate", "--database-url", db, "--data-dir", dir); code != 0 {
		t.Fatalf("migrate: %d %s %s", code, out, errs)
	}
	pgExec(t, db, setup...)
	addr := freeAddr(t)
	start(t, "http://"+addr+"/healthz", ordersBin, append([]string{"serve", "--addr", addr, "--data-dir", dir, "--database-url", db,
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
func TestReviewCompleterStoresOrderNotWritable(t *testing.T) {
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

// Finding 5. The completer's MaxAttempts (20) counts the client's own
// attempts. A client that retries quickly through a short outage of the
// orders table (client.Transport retries 503 with Retry-After) spends
// them all, gives up, and the completer never re-drives the key: the
// payment made by the first attempt stays without its order for good,
// though the database is back a moment later. Invariant 2 ("no payment is
// left without its order once the completer has run, whether or not the
// client retried") is broken, and the audit says so.
func TestReviewClientRetriesSpendCompleterAttempts(t *testing.T) {
	db, dir, base := serveOnPG(t, blipTrigger, "--key-lease", "2s")
	body := `{"items":[{"sku":"SKU-1","quantity":1,"unit_price":1000}],"currency":"EUR"}`
	for i := 0; i < 20; i++ {
		if s, b := postBody(t, base, "impatient", "k-20", body); s != http.StatusServiceUnavailable {
			t.Fatalf("attempt %d during the outage: %d %s; want 503", i+1, s, b)
		}
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
