package ordersapp

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/pgconfig"
)

func (a *App) migrate(ctx context.Context, args []string) error {
	var c Config
	fs := cli.NewFlagSet("orders migrate", "Creates or upgrades the schema, gives every order made before events its orders.created event (serve does the same in the background at start), and exits.", a.Getenv)
	c.storageFlags(fs)
	if err := a.parse(fs, args); err != nil {
		return err
	}
	be, err := openBackend(ctx, &c)
	if err != nil {
		return err
	}
	defer be.close()
	// The in-process gateway's tables, when some instance set them up:
	// upgraded here too, so that the commands that migrate nothing find
	// them current. (serve sets them up when it pays through it.)
	switch ok, err := be.gatewayExists(ctx); {
	case err != nil:
		return fmt.Errorf("looking for the in-process gateway's ledger: %w", err)
	case ok:
		if _, _, err := be.gateway(ctx); err != nil {
			return fmt.Errorf("migrating the in-process gateway's tables: %w", err)
		}
	}
	n, err := backfillEvents(ctx, be, slog.New(slog.NewTextHandler(a.Stderr, nil)))
	if err != nil {
		return fmt.Errorf("writing the events of orders made before events: %w", err)
	}
	fmt.Fprintf(a.Stdout, "schema up to date (%s)\n", be.name)
	if n > 0 {
		fmt.Fprintf(a.Stdout, "wrote the orders.created event of %d orders made before events\n", n)
	}
	return nil
}

func (a *App) token(ctx context.Context, args []string) error {
	var c Config
	var user string
	var ttl time.Duration
	fs := cli.NewFlagSet("orders token", "Prints a bearer token for a user, signed with the service's secret: --jwt-secret when it is set; "+
		"else, with a postgres:// --database-url, the one kept in that database, which every `orders serve` on it without --jwt-secret uses "+
		"(the schema must exist: run `orders migrate` or `orders serve` first); else the one kept in the data dir.", a.Getenv)
	fs.String(&user, "user", "ORDERS_TOKEN_USER", "", "user id, the token's sub (required; 1-255 bytes of text, not beginning with \"$\", which the service reserves for its consumers)")
	fs.Duration(&ttl, "ttl", "ORDERS_TOKEN_TTL", 24*time.Hour, "how long the token is valid, at most 720h (the API refuses a token valid for longer)")
	fs.String(&c.DataDir, "data-dir", "ORDERS_DATA_DIR", "./data", "directory holding the generated JWT secret (with a postgres:// --database-url: the secret offered to the database when it keeps none yet)")
	fs.String(&c.DatabaseURL, "database-url", "DATABASE_URL", "", "the service's database: postgres://… to sign with the secret kept there; empty or sqlite: for the data dir's")
	c.secretFlags(fs)
	if err := a.parse(fs, args); err != nil {
		return err
	}
	if user == "" {
		return cli.Usagef("orders token: --user is required")
	}
	if err := orders.CheckTokenUser(user); err != nil {
		return cli.Usagef("orders token: --user: %v", err)
	}
	if ttl <= 0 {
		return cli.Usagef("orders token: --ttl must be positive")
	}
	if ttl > orders.MaxTokenLifetime {
		return cli.Usagef("orders token: --ttl %v is over 720h, the longest lifetime the API accepts", ttl)
	}
	if err := c.checkStorage(); err != nil {
		return err
	}
	if _, ok := c.sqlitePath(); !ok && !strings.HasPrefix(c.DatabaseURL, "postgres://") && !strings.HasPrefix(c.DatabaseURL, "postgresql://") {
		return cli.Usagef("orders token: --database-url %q: want empty (embedded SQLite), sqlite:PATH or postgres://…", redactURL(c.DatabaseURL))
	}
	var secret []byte
	var err error
	if c.secretInDatabase() {
		secret, err = a.databaseSecret(ctx, &c)
	} else {
		secret, err = c.secret()
	}
	if err != nil {
		return err
	}
	tok, err := orders.IssueToken(secret, user, ttl, time.Now())
	if err != nil {
		return err
	}
	fmt.Fprintln(a.Stdout, tok)
	return nil
}

func (a *App) gc(ctx context.Context, args []string) error {
	var c Config
	var batch int
	var pause time.Duration
	fs := cli.NewFlagSet("orders gc", "Deletes expired idempotency keys once, in batches, and prints how many: the order store's, then the in-process gateway's.", a.Getenv)
	c.storageFlags(fs)
	fs.Int(&batch, "batch", "ORDERS_GC_BATCH", 1000, 1, 100000, "keys deleted per batch")
	fs.Duration(&pause, "pause", "ORDERS_GC_PAUSE", 10*time.Millisecond, "pause between batches")
	if err := a.parse(fs, args); err != nil {
		return err
	}
	be, err := openExisting(ctx, &c) // it deletes rows of an existing schema; it creates and migrates nothing
	if err != nil {
		return err
	}
	defer be.close()
	start := time.Now()
	last := start
	n, err := be.cleaner(idem.CleanerOptions{Batch: batch, Pause: pause, Progress: func(total int) {
		if time.Since(last) >= time.Second {
			last = time.Now()
			fmt.Fprintf(a.Stderr, "deleted %d so far\n", total)
		}
	}}).RunOnce(ctx)
	el := time.Since(start)
	fmt.Fprintf(a.Stdout, "deleted %d expired keys in %s (%.0f keys/s)\n", n, el.Round(time.Millisecond), float64(n)/max(el.Seconds(), 1e-9))
	if err != nil {
		return err
	}
	// The in-process gateway keeps its own keys in the same database, as
	// serve's cleaner knows; an external gateway forgets its own.
	p, _, err := newPayer(ctx, &c, be)
	if err != nil {
		return err
	}
	gn := 0
	if p.gw != nil {
		gn, err = p.gw.NewCleaner(idem.CleanerOptions{Batch: batch, Pause: pause}).RunOnce(ctx)
	}
	fmt.Fprintf(a.Stdout, "deleted %d expired keys of the in-process gateway\n", gn)
	return err
}

// databaseSecret returns the JWT secret kept in the PostgreSQL database
// that c names (Config.sharedSecret), as serve reads it, without
// migrating: a database without the schema is an error that says so.
func (a *App) databaseSecret(ctx context.Context, c *Config) ([]byte, error) {
	cfg, err := pgxpool.ParseConfig(c.DatabaseURL)
	if err != nil {
		return nil, cli.Usagef("--database-url: %v", err)
	}
	cfg.MaxConns = 1
	pgconfig.Apply(cfg, c.DatabaseURL)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connecting to PostgreSQL: %w", err)
	}
	defer pool.Close()
	return c.sharedSecret(ctx, pool, slog.New(slog.NewTextHandler(a.Stderr, nil)))
}
