package redisfront_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/redisfront"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// Example puts Redis in front of PostgreSQL: a replay (and a duplicate
// that arrives while the first request runs) is answered by Redis;
// PostgreSQL decides everything else. The handler is the one it would be
// on pgstore alone: pgstore.FromContext unwraps the transaction that
// redisfront wraps.
//
// It runs in go test against real servers (see exampleServers):
// TEST_DATABASE_URL and TEST_REDIS_URL, by default
// postgres://root@127.0.0.1:5432/test and redis://127.0.0.1:6379.
// Without them (and outside CI) it is skipped, as the other tests that
// need the servers are (TestMain).
func Example() {
	ctx := context.Background()
	// A service: pgxpool.New(ctx, os.Getenv("DATABASE_URL")) and
	// redis.ParseURL(os.Getenv("REDIS_URL")).
	pool, ropts, prefix, cleanup := exampleServers(ctx)
	defer cleanup()

	if err := pgstore.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id bigserial PRIMARY KEY, item text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	// ContextTimeoutEnabled lets each Redis call end at its deadline
	// (Options.Timeout) on the caller's goroutine.
	ropts.ContextTimeoutEnabled = true
	rdb := redis.NewClient(ropts)
	defer rdb.Close()
	store := redisfront.New(rdb, pgstore.New(pool, pgstore.Options{}), redisfront.Options{KeyPrefix: prefix})

	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := pgstore.FromContext(r.Context())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		var id int64
		if err := tx.QueryRow(r.Context(), `INSERT INTO orders (item) VALUES ('book') RETURNING id`).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d", id)
	})
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(createOrder)

	for range 2 {
		req := httptest.NewRequest("POST", "/v1/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", "order-1")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Printf("%d %s replayed=%q\n", rec.Code, rec.Body, rec.Header().Get("Idempotent-Replayed"))
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("orders:", n)
	// Output:
	// 201 order 1 replayed=""
	// 201 order 1 replayed="true"
	// orders: 1
}

// exampleServers returns a pool on TEST_DATABASE_URL whose search_path
// selects a new schema of this run's own, the options of TEST_REDIS_URL,
// and a Redis key prefix of this run's own, so that the example neither
// sees nor leaves anything on the shared servers; cleanup drops the
// schema, deletes the keys under the prefix and closes the pool.
func exampleServers(ctx context.Context) (pool *pgxpool.Pool, ropts *redis.Options, prefix string, cleanup func()) {
	dbURL, redisURL := os.Getenv("TEST_DATABASE_URL"), os.Getenv("TEST_REDIS_URL")
	if dbURL == "" {
		dbURL = "postgres://root@127.0.0.1:5432/test"
	}
	if redisURL == "" {
		redisURL = "redis://127.0.0.1:6379"
	}
	ropts, err := redis.ParseURL(redisURL)
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(ropts)
	prefix = fmt.Sprintf("redisfront-example-%d:", os.Getpid())
	if err := rdb.Ping(ctx).Err(); err != nil {
		log.Fatalf("the redisfront example needs Redis (TEST_REDIS_URL): %v", err)
	}

	schema := fmt.Sprintf("redisfront_example_%d", os.Getpid())
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		log.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+schema); err != nil {
		log.Fatalf("the redisfront example needs PostgreSQL (TEST_DATABASE_URL): %v", err)
	}

	return pool, ropts, prefix, func() {
		ctx := context.Background()
		iter := rdb.Scan(ctx, 0, prefix+"*", 100).Iterator()
		for iter.Next(ctx) {
			rdb.Del(ctx, iter.Val())
		}
		if err := iter.Err(); err != nil {
			log.Printf("deleting keys %s*: %v", prefix, err)
		}
		rdb.Close()
		if _, err := pool.Exec(ctx, `DROP SCHEMA `+schema+` CASCADE`); err != nil {
			log.Printf("dropping schema %s: %v", schema, err)
		}
		pool.Close()
	}
}
