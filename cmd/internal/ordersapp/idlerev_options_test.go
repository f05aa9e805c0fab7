package ordersapp

// Second reading of 5bcb404: a finding (fails on main; kept out of the
// commits). The URL's other way to set a server setting is overridden.

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/pgtest"
)

// TestIdlerevSettingFromURLOptions: libpq's other way for a URL to set a
// server setting is options=-c name=value (PostgreSQL's own documented
// form, used by pgbouncer-free deployments and by libpq tools alike). The
// check in openPostgres looks only for a parameter of that name, adds its
// own beside the options, and PostgreSQL applies the startup packet's
// parameters after its options: the lease silently replaces the value the
// URL asked for.
func TestIdlerevSettingFromURLOptions(t *testing.T) {
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
		if got := idlerevSessionSetting(t, idlerevWithQuery(t, db, "options", opt), 2*time.Second); got != want {
			t.Errorf("URL options=%q: session has idle_in_transaction_session_timeout %s, want %s (the URL's value; the commit says the URL's setting is kept)", opt, got, want)
		}
	}
	// pgx reads the same options from PGOPTIONS, as libpq does.
	t.Setenv("PGOPTIONS", "-c idle_in_transaction_session_timeout=0")
	if got := idlerevSessionSetting(t, db, 2*time.Second); got != "0" {
		t.Errorf("PGOPTIONS=%q: session has idle_in_transaction_session_timeout %s, want 0 (the connection's own setting)", os.Getenv("PGOPTIONS"), got)
	}
}
