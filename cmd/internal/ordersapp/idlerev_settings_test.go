package ordersapp

// Second reading of 5bcb404 (idle_in_transaction_session_timeout = the key
// lease on every session of `orders serve`'s pool, unless the URL sets
// it): what the sessions of openPostgres actually run with, for each way
// a URL can say it.

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
)

// idlerevSessionSetting opens the backend on dbURL with lease and returns
// idle_in_transaction_session_timeout as a session of its pool has it.
func idlerevSessionSetting(t *testing.T, dbURL string, lease time.Duration) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	be, err := openPostgres(ctx, dbURL, lease)
	if err != nil {
		t.Fatalf("openPostgres(%s): %v", dbURL, err)
	}
	defer be.close()
	tx, err := be.store.Begin(ctx, &idemdriver.Lease{User: "idlerev", Key: "idlerev", Owner: idemdriver.NewOwner()})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var v string
	if err := tx.(*pgstore.Tx).PgxTx().QueryRow(ctx, `SELECT current_setting('idle_in_transaction_session_timeout')`).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// idlerevWithQuery returns dbURL with the query parameter k=v added.
func idlerevWithQuery(t *testing.T, dbURL, k, v string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set(k, v)
	// %20, not +: pgx decodes the query as a path (url.PathUnescape).
	u.RawQuery = strings.ReplaceAll(q.Encode(), "+", "%20")
	return u.String()
}

// TestIdlerevSettingDefaults: without a setting in the URL a session ends
// a transaction idle for the lease, and never for less than 1 s (a lease
// under a second, or of 1500 ms, is not rounded to 0 = off).
func TestIdlerevSettingDefaults(t *testing.T) {
	db := pgtest.Database(t)
	for _, tc := range []struct {
		lease time.Duration
		want  string
	}{
		{2 * time.Second, "2s"},
		{1500 * time.Millisecond, "1500ms"},
		{300 * time.Millisecond, "1s"},
		{time.Nanosecond, "1s"},
	} {
		if got := idlerevSessionSetting(t, db, tc.lease); got != tc.want {
			t.Errorf("lease %v: session has idle_in_transaction_session_timeout %s, want %s", tc.lease, got, tc.want)
		}
	}
}

// TestIdlerevSettingFromURLParameter: a URL that sets the parameter
// itself keeps its value (0: off), as the commit says.
func TestIdlerevSettingFromURLParameter(t *testing.T) {
	db := pgtest.Database(t)
	if got := idlerevSessionSetting(t, idlerevWithQuery(t, db, "idle_in_transaction_session_timeout", "0"), 2*time.Second); got != "0" {
		t.Errorf("URL idle_in_transaction_session_timeout=0: session has %s, want 0 (the URL's value)", got)
	}
	if got := idlerevSessionSetting(t, idlerevWithQuery(t, db, "idle_in_transaction_session_timeout", "600000"), 2*time.Second); got != "10min" {
		t.Errorf("URL idle_in_transaction_session_timeout=600000: session has %s, want 10min (the URL's value)", got)
	}
}
