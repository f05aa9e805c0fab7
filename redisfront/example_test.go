package redisfront_test

import (
	"context"
	"log"
	"net/http"
	"os"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/redisfront"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// Redis in front of PostgreSQL: duplicates in flight and replays are
// answered by Redis; PostgreSQL decides everything else.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	if err := pgstore.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	// ContextTimeoutEnabled lets each Redis call end at its deadline
	// (Options.Timeout) on the caller's goroutine.
	rdb := redis.NewUniversalClient(&redis.UniversalOptions{
		Addrs:                 []string{"127.0.0.1:6379"},
		ContextTimeoutEnabled: true,
	})
	store := redisfront.New(rdb, pgstore.New(pool, pgstore.Options{}), redisfront.Options{})

	orders := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The handler writes through the request's transaction, which
		// redisfront wraps: unwrap it to reach pgstore's.
		tx, err := idem.TxFromContext(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		ptx := tx.(*redisfront.Tx).Unwrap().(*pgstore.Tx)
		if _, err := ptx.PgxTx().Exec(r.Context(), `INSERT INTO orders DEFAULT VALUES`); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	http.Handle("POST /v1/orders", idem.Middleware(store, idem.Options{})(orders))
}
