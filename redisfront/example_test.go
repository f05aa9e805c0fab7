package redisfront_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/redisfront"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// Redis in front of PostgreSQL: duplicates in flight and replays are
// answered by Redis; PostgreSQL decides everything else. The handler is
// the one it would be on pgstore alone: pgstore.FromContext unwraps the
// request's transaction, which redisfront wraps.
//
// It needs PostgreSQL (DATABASE_URL) and Redis (REDIS_URL), so it has no
// Output section and go test only compiles it;
// TestExampleRunsOnRedisAndPostgres runs it against the tests' servers and
// checks that it prints:
//
//	201 order 1 replayed=""
//	201 order 1 replayed="true"
//	orders: 1
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := pgstore.Migrate(ctx, pool); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (id bigserial PRIMARY KEY, item text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	ropts, err := redis.ParseURL(os.Getenv("REDIS_URL"))
	if err != nil {
		log.Fatal(err)
	}
	// ContextTimeoutEnabled lets each Redis call end at its deadline
	// (Options.Timeout) on the caller's goroutine.
	ropts.ContextTimeoutEnabled = true
	rdb := redis.NewClient(ropts)
	defer rdb.Close()
	store := redisfront.New(rdb, pgstore.New(pool, pgstore.Options{}), redisfront.Options{KeyPrefix: "shop:idem:"})

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
	mux := http.NewServeMux()
	mux.Handle("POST /v1/orders", idem.Middleware(store, idem.Options{})(createOrder))

	srv := httptest.NewServer(mux) // a service would http.ListenAndServe
	defer srv.Close()
	for range 2 {
		req, _ := http.NewRequest("POST", srv.URL+"/v1/orders", strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", "order-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("%d %s replayed=%q\n", resp.StatusCode, body, resp.Header.Get("Idempotent-Replayed"))
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("orders:", n)
}

// TestExampleRunsOnRedisAndPostgres runs Example on a database of its own
// and the tests' Redis, and checks what it prints, as go test checks an
// Output section. The example's keys (prefix shop:idem:) are deleted before
// and after, so that an answer cached by an earlier run is not replayed.
func TestExampleRunsOnRedisAndPostgres(t *testing.T) {
	rdb := newRedis(t)
	t.Setenv("REDIS_URL", redisURL(t))
	t.Setenv("DATABASE_URL", pgtest.Database(t))
	exampleDeleteKeys(t, rdb, "shop:idem:")
	t.Cleanup(func() { exampleDeleteKeys(t, rdb, "shop:idem:") })
	got := exampleStdout(t, Example)
	want := "201 order 1 replayed=\"\"\n201 order 1 replayed=\"true\"\norders: 1\n"
	if got != want {
		t.Fatalf("Example printed\n%s\nwant\n%s", got, want)
	}
}

// exampleDeleteKeys deletes the keys under prefix.
func exampleDeleteKeys(t *testing.T, rdb *redis.Client, prefix string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	iter := rdb.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	for iter.Next(ctx) {
		if err := rdb.Del(ctx, iter.Val()).Err(); err != nil {
			t.Errorf("deleting %s: %v", iter.Val(), err)
		}
	}
	if err := iter.Err(); err != nil {
		t.Errorf("scanning %s*: %v", prefix, err)
	}
}

// exampleStdout returns what run prints on os.Stdout.
func exampleStdout(t *testing.T, run func()) string {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan string)
	go func() {
		b, _ := io.ReadAll(r)
		out <- string(b)
	}()
	stdout := os.Stdout
	os.Stdout = w
	defer func() { os.Stdout = stdout }()
	run()
	w.Close()
	return <-out
}
