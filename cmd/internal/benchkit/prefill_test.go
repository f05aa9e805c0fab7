package benchkit_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/benchkit"
	"github.com/idem-go/idem/cmd/internal/benchkit/benchtest"
)

// TestPrefillRows prefills the PostgreSQL table (and the one under benchkit.Redis)
// in several batches and checks the rows: n live keys of prefill users,
// none of the workload's; a run's keys are then deleted by ResetKeys and
// the prefilled ones kept.
func TestPrefillRows(t *testing.T) {
	defer benchkit.SetPrefillBatch(1000)()
	for _, store := range []string{benchkit.Postgres, benchkit.Redis} {
		t.Run(store, func(t *testing.T) {
			tgt := benchtest.NewForTest(t, store, true)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			const n = 2345
			var calls []int64
			if err := tgt.Prefill(ctx, n, func(done int64) { calls = append(calls, done) }); err != nil {
				t.Fatal(err)
			}
			if want := []int64{1000, 2000, 2345}; len(calls) != 3 || calls[0] != want[0] || calls[1] != want[1] || calls[2] != want[2] {
				t.Errorf("progress %v, want %v", calls, want)
			}
			var total, live, users, distinctKeys int64
			err := tgt.Pool().QueryRow(ctx, `SELECT count(*),
				count(*) FILTER (WHERE response_status = 201 AND response_body IS NOT NULL AND completed_at IS NOT NULL
					AND expires_at > now() + interval '1 hour' AND created_at <= now() AND user_id LIKE 'prefill-%'),
				count(DISTINCT user_id), count(DISTINCT key)
				FROM idempotency_keys`).Scan(&total, &live, &users, &distinctKeys)
			if err != nil {
				t.Fatal(err)
			}
			if total != n || live != n || distinctKeys != n || users != (n+99)/100 {
				t.Fatalf("%d rows, %d live prefill keys, %d users, %d distinct keys; want %d, %d, %d, %d", total, live, users, distinctKeys, n, n, (n+99)/100, n)
			}
			if got, err := tgt.PrefilledKeys(ctx); err != nil || got != n {
				t.Fatalf("PrefilledKeys = %d, %v", got, err)
			}
			if b, err := tgt.TableBytes(ctx); err != nil || b <= 0 {
				t.Fatalf("TableBytes = %d, %v", b, err)
			}
			// The workload's keys are its own: creates answer 201, and
			// ResetKeys deletes exactly them.
			w := benchkit.NewWorkload(benchkit.Create, 3)
			for range 5 {
				if rec := benchtest.Do(t, tgt, w, w.Next()); rec.Code != http.StatusCreated || benchkit.Replayed(rec.Header()) {
					t.Fatalf("create after prefill: %d %s", rec.Code, rec.Body)
				}
			}
			if _, err := tgt.ResetKeys(ctx, []string{"prefill-0000001"}); err == nil {
				t.Error("ResetKeys accepted a prefill user")
			}
			if del, err := tgt.ResetKeys(ctx, w.Users[:2]); err != nil || del != 4 {
				t.Fatalf("ResetKeys of two users deleted %d, %v; want 4", del, err)
			}
			if del, err := tgt.ResetKeys(ctx, w.Users); err != nil || del != 1 {
				t.Fatalf("ResetKeys deleted %d, %v; want the last 1", del, err)
			}
			if got, err := tgt.PrefilledKeys(ctx); err != nil || got != n {
				t.Fatalf("after ResetKeys, PrefilledKeys = %d, %v", got, err)
			}
			// CloseIdle leaves no connection open; the pool opens one
			// again when needed.
			if tgt.Pool().Stat().TotalConns() == 0 {
				t.Fatal("no connection open before CloseIdle: the check below proves nothing")
			}
			tgt.CloseIdle()
			if c := tgt.Pool().Stat().TotalConns(); c != 0 {
				t.Errorf("%d connections open after CloseIdle", c)
			}
			if got, err := tgt.PrefilledKeys(ctx); err != nil || got != n {
				t.Fatalf("after CloseIdle, PrefilledKeys = %d, %v", got, err)
			}
		})
	}
	// benchkit.Memory and SQLite have no table to prefill.
	if err := benchtest.NewForTest(t, benchkit.Memory, true).Prefill(context.Background(), 10, nil); err == nil {
		t.Error("Prefill on the memory store did not fail")
	}
}
