package pgstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/storetest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Under every QueryExecMode a pool may be configured with (pgbouncer users
// pick the simple protocol or Exec), a create commits the handler's write
// with its answer, a fenced completion commits nothing and is ErrFenced,
// a completion without statement works, and a repeat replays.
func TestEveryQueryExecMode(t *testing.T) {
	modes := map[string]pgx.QueryExecMode{
		"simple":         pgx.QueryExecModeSimpleProtocol,
		"exec":           pgx.QueryExecModeExec,
		"cache-describe": pgx.QueryExecModeCacheDescribe,
		"describe-exec":  pgx.QueryExecModeDescribeExec,
	}
	for name, mode := range modes {
		t.Run(name, func(t *testing.T) {
			pool := pgtest.Pool(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			ctx := context.Background()
			if err := pgstore.Migrate(ctx, pool); err != nil {
				t.Fatal(err)
			}
			if _, err := pool.Exec(ctx, `CREATE TABLE effects (name text NOT NULL)`); err != nil {
				t.Fatal(err)
			}
			clock := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
			s := pgstore.New(pool, pgstore.Options{Now: clock.Now})
			b := &testBundle{pool: pool, clock: clock}

			// Create, then replay.
			p := params("u", "adv-mode-create", "fp")
			tx := begin(t, s, lease(t, s, p), "adv-create")
			if _, err := tx.(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO effects (name) VALUES ('adv-create')`); err != nil {
				t.Fatal(err)
			}
			if err := tx.Complete(ctx, response("created")); err != nil {
				t.Fatalf("Complete: %v", err)
			}
			if n := effects(t, b, "adv-create"); n != 2 {
				t.Fatalf("%d effects committed, want 2", n)
			}
			if c, err := s.Claim(ctx, p); err != nil || c.Response == nil || string(c.Response.Body) != "created" {
				t.Fatalf("replay: %+v, %v", c, err)
			}
			// A repeat while in flight: 409.
			q := params("u", "adv-mode-409", "fp")
			lease(t, s, q)
			var inflight *idem.InFlightError
			if _, err := s.Claim(ctx, q); !errors.As(err, &inflight) {
				t.Fatalf("repeat in flight: %v", err)
			}

			// Fenced after a write.
			f := params("u", "adv-mode-fenced", "fp")
			f.Lease = time.Second
			ftx := begin(t, s, lease(t, s, f), "adv-fenced")
			clock.Advance(2 * time.Second)
			if c, err := s.Claim(ctx, f); err != nil || c.Lease == nil {
				t.Fatalf("takeover: %+v, %v", c, err)
			}
			if err := ftx.Complete(ctx, response("fenced")); !errors.Is(err, idem.ErrFenced) {
				t.Fatalf("fenced Complete = %v, want ErrFenced", err)
			}
			if n := effects(t, b, "adv-fenced"); n != 0 {
				t.Fatalf("a fenced attempt's write committed")
			}
			if _, st := keyRecord(t, b, "u", "adv-mode-fenced"); st != nil {
				t.Fatalf("a fenced attempt stored %d", *st)
			}

			// No statement, then fenced without statement.
			n := params("u", "adv-mode-nostmt", "fp")
			n.Lease = time.Second
			ntx, err := s.Begin(ctx, lease(t, s, n))
			if err != nil {
				t.Fatal(err)
			}
			if err := ntx.Complete(ctx, response("none")); err != nil {
				t.Fatalf("Complete without statement: %v", err)
			}
			if _, st := keyRecord(t, b, "u", "adv-mode-nostmt"); st == nil {
				t.Fatal("nothing stored")
			}
			// Connections are back outside a transaction.
			for _, c := range pool.AcquireAllIdle(ctx) {
				if st := c.Conn().PgConn().TxStatus(); st != 'I' {
					t.Errorf("pooled connection in status %q", st)
				}
				c.Release()
			}
		})
	}
}
