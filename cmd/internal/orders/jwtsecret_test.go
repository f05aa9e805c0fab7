package orders

import (
	"context"
	"errors"
	"fmt"
	neturl "net/url"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem/cmd/internal/pgconfig"
	"github.com/idem-go/idem/internal/pgtest"
)

// exerciseSharedSecret calls SharedSecret from 16 goroutines at once on
// pool's migrated schema, each offering a secret of its own, and checks
// that exactly one offer is stored and that every call returns it.
func exerciseSharedSecret(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	const n = 16
	got := make([]string, n)
	stored := make([]bool, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], stored[i], errs[i] = SharedSecret(ctx, pool, fmt.Sprintf("offer-%02d-%s", i, strings.Repeat("x", 32)))
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("SharedSecret: %v", err)
	}
	winners := 0
	for i := range n {
		if stored[i] {
			winners++
			if want := fmt.Sprintf("offer-%02d-%s", i, strings.Repeat("x", 32)); got[i] != want {
				t.Errorf("call %d stored its offer but returned another secret", i)
			}
		}
		if got[i] != got[0] {
			t.Errorf("call %d returned another secret than call 0", i)
		}
	}
	if winners != 1 {
		t.Errorf("%d calls stored their offer, want 1", winners)
	}
	// Later calls read it, whatever they offer.
	again, st, err := SharedSecret(ctx, pool, strings.Repeat("y", 40))
	if err != nil || st || again != got[0] {
		t.Errorf("a later call: stored %v, same secret %v, err %v; want the kept one", st, again == got[0], err)
	}
}

// TestSharedSecretOneForAll: callers that start at once agree on one
// secret, the first stored; a short offer is refused; a database without
// the table says to migrate.
func TestSharedSecretOneForAll(t *testing.T) {
	ctx := context.Background()
	pool := pgPool(t)
	if _, _, err := SharedSecret(ctx, pool, strings.Repeat("z", 40)); !errors.Is(err, ErrNoSecretTable) {
		t.Errorf("before migrating: err %v, want ErrNoSecretTable", err)
	}
	if err := MigratePostgres(ctx, pool); err != nil {
		t.Fatalf("MigratePostgres: %v", err)
	}
	if _, _, err := SharedSecret(ctx, pool, "short"); err == nil || strings.Contains(err.Error(), "short") {
		t.Errorf("a 5-byte offer: err %v, want an error that does not repeat it", err)
	}
	exerciseSharedSecret(t, pool)
}

// TestSharedSecretBehindPgBouncer: the migration and SharedSecret work
// through PgBouncer in transaction pooling mode, with the pool settings
// of the service (pgconfig.Apply).
func TestSharedSecretBehindPgBouncer(t *testing.T) {
	b := pgtest.NewBouncer(t)
	db := pgtest.Database(t)
	u, err := neturl.Parse(db)
	if err != nil {
		t.Fatal(err)
	}
	url := b.URL(u.Path[1:])
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 6
	pgconfig.Apply(cfg, url)
	ctx := context.Background()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := MigratePostgres(ctx, pool); err != nil {
		t.Fatalf("MigratePostgres through PgBouncer: %v", err)
	}
	exerciseSharedSecret(t, pool)
}
