package pgstore_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
)

// TestClaimRaceUnderStrictIsolation: with the database's default
// isolation at REPEATABLE READ or SERIALIZABLE, racing claims of one key
// raise serialization failures (40001); the middleware sends the claim
// again, so every racer gets a final answer (201, a replay, or 409 while
// the first runs) and never a 503. (Issue 9, point 6.)
func TestClaimRaceUnderStrictIsolation(t *testing.T) {
	for _, level := range []string{"repeatable read", "serializable"} {
		t.Run(level, func(t *testing.T) {
			ctx := context.Background()
			plain := migratedPool(t)
			var schema string
			if err := plain.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
				t.Fatal(err)
			}
			cfg, err := pgxpool.ParseConfig(pgtest.URL(t))
			if err != nil {
				t.Fatal(err)
			}
			cfg.ConnConfig.RuntimeParams["search_path"] = schema
			cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = level
			cfg.MaxConns = 16
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			store := pgstore.New(pool, pgstore.Options{})
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				tx, err := pgstore.FromContext(r.Context())
				if err != nil {
					w.WriteHeader(http.StatusInternalServerError)
					return
				}
				if _, err := tx.Exec(r.Context(), `INSERT INTO effects (name) VALUES ('strict')`); err != nil {
					w.WriteHeader(http.StatusInternalServerError)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})
			metrics := new(idem.Metrics)
			srv := httptest.NewServer(idem.Middleware(store, idem.Options{User: idem.SharedKeySpace, Metrics: metrics})(h))
			defer srv.Close()

			const racers = 40
			statuses := make(chan int, racers*5)
			var wg sync.WaitGroup
			for k := range 5 {
				for range racers / 5 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(`{}`))
						req.Header.Set("Idempotency-Key", fmt.Sprintf("strict-%d", k))
						resp, err := http.DefaultClient.Do(req)
						if err != nil {
							statuses <- -1
							return
						}
						io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
						statuses <- resp.StatusCode
					}()
				}
			}
			wg.Wait()
			close(statuses)
			got := map[int]int{}
			for s := range statuses {
				got[s]++
			}
			t.Logf("%s: answers %v, store calls sent again %d", level, got, metrics.StoreRetries.Load())
			for s, n := range got {
				if s != http.StatusCreated && s != http.StatusConflict {
					t.Errorf("%d answers with status %d (all: %v); want only 201 and 409", n, s, got)
				}
			}
			var effects int
			if err := plain.QueryRow(ctx, `SELECT count(*) FROM effects WHERE name = 'strict'`).Scan(&effects); err != nil {
				t.Fatal(err)
			}
			if effects != 5 {
				t.Errorf("effects = %d, want 5 (one per key)", effects)
			}
		})
	}
}
