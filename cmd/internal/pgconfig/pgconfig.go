// Package pgconfig holds the settings that every PostgreSQL pool the
// order service and the gateway build gets, whatever the server or
// pooler behind the URL.
package pgconfig

import (
	"context"
	"errors"
	"fmt"
	neturl "net/url"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Apply sets what cfg, parsed from url, does not set itself:
//
//   - on a database whose encoding is SQL_ASCII (initdb or pg_autoctl
//     under the C locale), client_encoding UTF8, set on each new
//     connection. pgx writes arguments into a simple-protocol query only
//     on a UTF8 session, which the stores' one-round-trip completion
//     needs; SQL_ASCII converts nothing either way, so the bytes stored
//     are the same. A database in another encoding (LATIN1, say) keeps
//     its own: there a UTF8 session would convert every string, and the
//     same user and key would name other rows than the ones written
//     before; the stores then complete in two round trips. A
//     client_encoding in the URL, its options or PGCLIENTENCODING is
//     kept.
//   - the query mode cache_describe instead of pgx's default,
//     cache_statement: no named prepared statement, so the pool works
//     behind PgBouncer in transaction mode (whose server connections
//     change between transactions) as on a direct connection. A URL's
//     default_query_exec_mode is kept (cache_statement is the faster
//     choice on a direct connection).
func Apply(cfg *pgxpool.Config, url string) {
	if _, ok := cfg.ConnConfig.RuntimeParams["client_encoding"]; !ok && !setInOptions(cfg, "client_encoding") {
		next := cfg.AfterConnect
		cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
			if next != nil {
				if err := next(ctx, conn); err != nil {
					return err
				}
			}
			pc := conn.PgConn()
			if pc.ParameterStatus("server_encoding") != "SQL_ASCII" || pc.ParameterStatus("client_encoding") == "UTF8" {
				return nil
			}
			if _, err := conn.Exec(ctx, `SET client_encoding TO 'UTF8'`); err != nil {
				return fmt.Errorf("setting client_encoding: %w", err)
			}
			return nil
		}
	}
	if !urlSets(url, "default_query_exec_mode") {
		cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheDescribe
	}
}

// StoreMode is the query mode for pgstore.Options.QueryExecMode on a
// pool Apply configured from url: the URL's default_query_exec_mode when
// it names one (cache_statement, say, which the store would otherwise
// replace by cache_describe), else 0, the store's default.
func StoreMode(cfg *pgxpool.Config, url string) pgx.QueryExecMode {
	if urlSets(url, "default_query_exec_mode") {
		return cfg.ConnConfig.DefaultQueryExecMode
	}
	return 0
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
