package ordersapp

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
)

// TestKeysPostgres: show, list and redrive on PostgreSQL, by the
// database's clock: a key given up is listed and shown given-up,
// re-driven once (count back to 0, nothing else changed), then refused as
// abandoned; an in-flight key is refused and left alone.
func TestKeysPostgres(t *testing.T) {
	dbURL := pgtest.Database(t)
	ctx := context.Background()
	c := Config{DatabaseURL: dbURL}
	be, err := openBackend(ctx, &c)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"pg-given-up", "pg-flight"} {
		if _, err := be.store.Claim(ctx, idemdriver.ClaimParams{User: "alice", Key: k, Fingerprint: "fp", Method: "POST", Path: "/v1/orders", Lease: time.Hour}); err != nil {
			t.Fatal(err)
		}
	}
	be.close()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `UPDATE idempotency_keys SET redrives = $1, lease_until = now() - interval '1 minute' WHERE key = 'pg-given-up'`, idem.DefaultCompleterMaxAttempts); err != nil {
		t.Fatal(err)
	}
	snapshot := func(key string) string {
		var s string
		if err := conn.QueryRow(ctx, `SELECT concat_ws(' ', owner, lease_until, attempts, redrives, created_at, expires_at, fingerprint)
			FROM idempotency_keys WHERE key = $1`, key).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	db := []string{"--database-url", dbURL}
	code, out, errs := run(t, nil, append([]string{"keys", "list", "--state", "given-up", "--json"}, db...)...)
	var views []keyView
	if code != 0 || json.Unmarshal([]byte(out), &views) != nil || len(views) != 1 || views[0].Key != "pg-given-up" || views[0].State != "given-up" {
		t.Fatalf("list given-up: exit %d\n%s%s", code, out, errs)
	}
	beforeFlight := snapshot("pg-flight")
	code, _, errs = run(t, nil, append([]string{"keys", "redrive", "--user", "alice", "--key", "pg-flight"}, db...)...)
	if code != 1 || !strings.Contains(errs, "in-flight") || snapshot("pg-flight") != beforeFlight {
		t.Errorf("redrive of an in-flight key: exit %d, %q; want 1, refused, the record unchanged", code, errs)
	}
	before := snapshot("pg-given-up")
	code, out, errs = run(t, nil, append([]string{"keys", "redrive", "--user", "alice", "--key", "pg-given-up"}, db...)...)
	if code != 0 || !strings.Contains(out, "after 20 re-drives") {
		t.Fatalf("redrive: exit %d\n%s%s", code, out, errs)
	}
	after := snapshot("pg-given-up")
	if want := strings.Replace(before, " 20 ", " 0 ", 1); after != want {
		t.Errorf("redrive changed more than the count:\nbefore %s\nafter  %s", before, after)
	}
	code, _, errs = run(t, nil, append([]string{"keys", "redrive", "--user", "alice", "--key", "pg-given-up"}, db...)...)
	if code != 1 || !strings.Contains(errs, "abandoned") {
		t.Errorf("second redrive: exit %d, %q; want 1, refused as abandoned", code, errs)
	}
	code, out, _ = run(t, nil, append([]string{"keys", "show", "--user", "alice", "--key", "pg-given-up"}, db...)...)
	if code != 0 || !strings.Contains(out, "abandoned") || !strings.Contains(out, "re-drives by the completer: 0 of 20") {
		t.Errorf("show after redrive: exit %d\n%s", code, out)
	}
}
