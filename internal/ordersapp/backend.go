package ordersapp

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/cli"
	"github.com/idem-go/idem/internal/orders"
	"github.com/idem-go/idem/sqlitestore"
)

// backend is the storage the service runs on: the idempotency store and the
// order repository share one database, so an order and its stored response
// commit in one transaction.
type backend struct {
	name    string // for logs: "sqlite:/path" or "postgres"
	store   idem.Store
	sweeper idem.Sweeper
	repo    orders.Repository
	close   func() error
}

// openBackend opens the database that c names and migrates it.
func openBackend(ctx context.Context, c *Config) (*backend, error) {
	u := c.DatabaseURL
	switch {
	case u == "":
		return openSQLite(ctx, filepath.Join(c.DataDir, "orders.db"))
	case strings.HasPrefix(u, "sqlite:"):
		return openSQLite(ctx, strings.TrimPrefix(strings.TrimPrefix(u, "sqlite:"), "//"))
	case strings.HasPrefix(u, "postgres://"), strings.HasPrefix(u, "postgresql://"):
		return nil, cli.Usagef("--database-url: PostgreSQL support is not built yet")
	default:
		return nil, cli.Usagef("--database-url %q: want empty (embedded SQLite), sqlite:PATH or postgres://…", u)
	}
}

func openSQLite(ctx context.Context, path string) (*backend, error) {
	if path == "" {
		return nil, cli.Usagef("--database-url: empty SQLite path")
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("creating the data dir: %w", err)
	}
	st, err := sqlitestore.Open(ctx, path, sqlitestore.Options{})
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", path, err)
	}
	if err := sqlitestore.ApplyMigrations(ctx, st.DB(), "orders", orders.SQLiteMigrations); err != nil {
		st.Close()
		return nil, fmt.Errorf("migrating %s: %w", path, err)
	}
	return &backend{
		name:    "sqlite:" + path,
		store:   st,
		sweeper: st,
		repo:    orders.NewSQLiteRepository(st.DB(), sqlitestore.FromContext),
		close:   st.Close,
	}, nil
}
