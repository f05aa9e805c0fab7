package orders

import (
	"context"
	"fmt"
	"testing"
)

// BenchmarkBackfillEvents: a BackfillEvents pass over 5000 and 20000
// orders (the op is the whole pass), on both databases: "none" when every order has
// its event (what each serve start costs), "all" when none has (an
// upgrade). The orders are written by SQL, their events removed before
// each "all" pass outside the timer. For ratios: how the pass grows with
// the orders is the point (linear, one read of each), not a time.
func BenchmarkBackfillEvents(b *testing.B) {
	for _, n := range []int{5000, 20000} {
		b.Run(fmt.Sprintf("orders=%d", n), func(b *testing.B) { benchmarkBackfillEvents(b, n) })
	}
}

func benchmarkBackfillEvents(b *testing.B, n int) {
	ctx := context.Background()
	for name, open := range map[string]func(b *testing.B) (backfiller, func(q string)){
		"SQLite": func(b *testing.B) (backfiller, func(q string)) {
			repo, db := openRepo(b)
			exec := func(q string) {
				if _, err := db.ExecContext(ctx, q); err != nil {
					b.Fatal(err)
				}
			}
			exec(fmt.Sprintf(`WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < %d)
				INSERT INTO orders (id, user_id, status, items, total, currency, payment_id, created_at)
				SELECT printf('ord_%%024x', i), 'user-' || (i %% 50), 'paid', '[{"sku":"A","quantity":1,"unit_price":100}]', 100, 'EUR', 'pi_' || i,
					strftime('%%Y-%%m-%%dT%%H:%%M:%%S', 1700000000 + i, 'unixepoch') || '.000000000Z' FROM s`, n))
			return repo, exec
		},
		"PostgreSQL": func(b *testing.B) (backfiller, func(q string)) {
			repo, pool := pgOpenRepo(b)
			exec := func(q string) {
				if _, err := pool.Exec(ctx, q); err != nil {
					b.Fatal(err)
				}
			}
			exec(fmt.Sprintf(`INSERT INTO orders (id, user_id, status, items, total, currency, payment_id, created_at)
				SELECT 'ord_' || lpad(to_hex(i), 24, '0'), 'user-' || (i %% 50), 'paid', '[{"sku":"A","quantity":1,"unit_price":100}]', 100, 'EUR', 'pi_' || i,
					to_timestamp(1700000000 + i) FROM generate_series(1, %d) i`, n))
			exec(`ANALYZE orders`)
			return repo, exec
		},
	} {
		b.Run(name, func(b *testing.B) {
			bf, exec := open(b)
			if added, err := bf.BackfillEvents(ctx, 500, nil); err != nil || added != n {
				b.Fatalf("first pass = %d, %v", added, err)
			}
			b.Run("none", func(b *testing.B) {
				for b.Loop() {
					if added, err := bf.BackfillEvents(ctx, 500, nil); err != nil || added != 0 {
						b.Fatalf("pass = %d, %v", added, err)
					}
				}
			})
			b.Run("all", func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					b.StopTimer()
					exec(`DELETE FROM idem_outbox`)
					exec(unmarkOrders)
					b.StartTimer()
					if added, err := bf.BackfillEvents(ctx, 500, nil); err != nil || added != n {
						b.Fatalf("pass = %d, %v", added, err)
					}
				}
			})
		})
	}
}
