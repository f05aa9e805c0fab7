package orders

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrNoSecretTable is returned by SharedSecret when the database has no
// jwt_secret table: its schema was not migrated yet.
var ErrNoSecretTable = errors.New("the database has no jwt_secret table: run `orders migrate` (or start `orders serve`) on it first")

// SharedSecret returns the JWT secret kept in the jwt_secret table of the
// schema that pool's search_path selects (migration 0005), which every
// instance on the database signs and checks tokens with. When the table
// holds none yet, offer (at least 32 bytes) is stored first; stored
// reports whether this call stored it. Several callers at once agree on
// one secret: the insert does nothing when another one's row is there
// (ON CONFLICT DO NOTHING, which waits for a concurrent insert to end),
// and the read that follows, in a statement of its own, sees whichever
// row was committed. Two statements, no transaction and no session state:
// it works through PgBouncer in transaction mode. Errors never hold the
// secret.
func SharedSecret(ctx context.Context, pool *pgxpool.Pool, offer string) (secret string, stored bool, err error) {
	if len(offer) < 32 {
		return "", false, fmt.Errorf("orders: the JWT secret offered is %d bytes; want at least 32", len(offer))
	}
	tag, err := pool.Exec(ctx, `INSERT INTO jwt_secret (secret) VALUES ($1) ON CONFLICT (singleton) DO NOTHING`, offer)
	if err != nil {
		return "", false, secretError("storing", err)
	}
	if err := pool.QueryRow(ctx, `SELECT secret FROM jwt_secret`).Scan(&secret); err != nil {
		return "", false, secretError("reading", err)
	}
	return secret, tag.RowsAffected() == 1, nil
}

func secretError(doing string, err error) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) && pe.Code == "42P01" { // undefined_table
		return ErrNoSecretTable
	}
	// A PgError's text is its message and code, never the row's values
	// (those are in its Detail).
	return fmt.Errorf("orders: %s the JWT secret kept in the database: %w", doing, err)
}
