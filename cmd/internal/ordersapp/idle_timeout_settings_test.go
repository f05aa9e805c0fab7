package ordersapp

// Second reading of 5bcb404 (idle_in_transaction_session_timeout = the key
// lease on every session of `orders serve`'s pool, unless the URL sets
// it): what the sessions of openPostgres actually run with, for each way
// a URL can say it.

import (
	"context"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
)

// idleSessionSetting opens the backend on dbURL with lease and returns
// idle_in_transaction_session_timeout as a session of its pool has it.
func idleSessionSetting(t *testing.T, dbURL string, lease time.Duration) string {
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

// withURLQuery returns dbURL with the query parameter k=v added.
func withURLQuery(t *testing.T, dbURL, k, v string) string {
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

// TestIdleTimeoutSettingDefaults: without a setting in the URL a session ends
// a transaction idle for the lease, and never for less than 1 s (a lease
// under a second, or of 1500 ms, is not rounded to 0 = off).
func TestIdleTimeoutSettingDefaults(t *testing.T) {
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
		if got := idleSessionSetting(t, db, tc.lease); got != tc.want {
			t.Errorf("lease %v: session has idle_in_transaction_session_timeout %s, want %s", tc.lease, got, tc.want)
		}
	}
}

// TestIdleTimeoutSettingFromURLParameter: a URL that sets the parameter
// itself keeps its value (0: off), as the commit says.
func TestIdleTimeoutSettingFromURLParameter(t *testing.T) {
	db := pgtest.Database(t)
	if got := idleSessionSetting(t, withURLQuery(t, db, "idle_in_transaction_session_timeout", "0"), 2*time.Second); got != "0" {
		t.Errorf("URL idle_in_transaction_session_timeout=0: session has %s, want 0 (the URL's value)", got)
	}
	if got := idleSessionSetting(t, withURLQuery(t, db, "idle_in_transaction_session_timeout", "600000"), 2*time.Second); got != "10min" {
		t.Errorf("URL idle_in_transaction_session_timeout=600000: session has %s, want 10min (the URL's value)", got)
	}
}

// TestIdleTimeoutSettingFromURLOptions checks that a URL setting
// idle_in_transaction_session_timeout through options=-c keeps its value.
//
// It guards a bug found in the second reading of 5bcb404, as it was found: libpq's other way for a URL to set a
// server setting is options=-c name=value (PostgreSQL's own documented
// form, used by pgbouncer-free deployments and by libpq tools alike). The
// check in openPostgres looks only for a parameter of that name, adds its
// own beside the options, and PostgreSQL applies the startup packet's
// parameters after its options: the lease silently replaces the value the
// URL asked for.
func TestIdleTimeoutSettingFromURLOptions(t *testing.T) {
	db := pgtest.Database(t)
	for _, opt := range []string{
		"-c idle_in_transaction_session_timeout=0",
		"-c idle_in_transaction_session_timeout=600000",
		"--idle_in_transaction_session_timeout=600000",
	} {
		want := "0"
		if strings.Contains(opt, "600000") {
			want = "10min"
		}
		if got := idleSessionSetting(t, withURLQuery(t, db, "options", opt), 2*time.Second); got != want {
			t.Errorf("URL options=%q: session has idle_in_transaction_session_timeout %s, want %s (the URL's value; the commit says the URL's setting is kept)", opt, got, want)
		}
	}
	// pgx reads the same options from PGOPTIONS, as libpq does.
	t.Setenv("PGOPTIONS", "-c idle_in_transaction_session_timeout=0")
	if got := idleSessionSetting(t, db, 2*time.Second); got != "0" {
		t.Errorf("PGOPTIONS=%q: session has idle_in_transaction_session_timeout %s, want 0 (the connection's own setting)", os.Getenv("PGOPTIONS"), got)
	}
}
