// Package pgconfig holds the settings that every PostgreSQL pool the
// order service and the gateway build gets, whatever the server or
// pooler behind the URL.
package pgconfig

import (
	"errors"
	neturl "net/url"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Apply sets what cfg, parsed from url, does not set itself:
//
//   - client_encoding UTF8. pgx sends every string as UTF-8 and writes
//     arguments into a simple-protocol query only on a UTF8 session; a
//     client that leaves the encoding to the database gets SQL_ASCII on a
//     database created under the C locale (initdb, pg_autoctl), where the
//     stores' completions would otherwise take a slower path.
//   - the query mode cache_describe instead of pgx's default,
//     cache_statement: no named prepared statement, so the pool works
//     behind PgBouncer in transaction mode (whose server connections
//     change between transactions) as on a direct connection. A URL's
//     default_query_exec_mode is kept (cache_statement is the faster
//     choice on a direct connection).
func Apply(cfg *pgxpool.Config, url string) {
	if _, ok := cfg.ConnConfig.RuntimeParams["client_encoding"]; !ok && !setInOptions(cfg, "client_encoding") {
		cfg.ConnConfig.RuntimeParams["client_encoding"] = "UTF8"
	}
	if !urlSets(url, "default_query_exec_mode") {
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
	}
}

// setInOptions reports whether the startup parameter options (from the
// URL or PGOPTIONS: -c name=value, --name=value) sets name.
func setInOptions(cfg *pgxpool.Config, name string) bool {
	return strings.Contains(strings.ReplaceAll(cfg.ConnConfig.RuntimeParams["options"], "-", "_"), strings.ReplaceAll(name, "-", "_"))
}

// urlSets reports whether url, a postgres:// URL or a key=value
// connection string, names the setting key.
func urlSets(url, key string) bool {
	if u, err := neturl.Parse(url); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		return u.Query().Has(key)
	}
	for _, f := range strings.Fields(url) {
		if k, _, ok := strings.Cut(f, "="); ok && strings.TrimSpace(k) == key {
			return true
		}
	}
	return false
}

// UnsupportedStartupParameter reports whether err is a pooler's refusal
// of a startup parameter (PgBouncer: "unsupported startup parameter:
// name", SQLSTATE 08P01), and which.
func UnsupportedStartupParameter(err error) (string, bool) {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "08P01" {
		return "", false
	}
	name, ok := strings.CutPrefix(pe.Message, "unsupported startup parameter: ")
	return strings.TrimSpace(name), ok
}
