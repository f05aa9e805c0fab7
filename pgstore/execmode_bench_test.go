package pgstore_test

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/pgstore"
	"github.com/jackc/pgx/v5"
)

// BenchmarkStoreQueryExecMode is the store's work for one create (Claim,
// Begin, the handler's INSERT, Complete) and one replay (Claim of a
// completed key), with the store's statements in each pgx mode a pool
// behind a transaction-mode pooler can use, and in cache_statement
// (named prepared statements, the fastest on a direct connection): the
// cost of the default, cache_describe, is the ratio of their ns/op, run
// side by side. The handler's INSERT is sent in cache_statement in every
// case, so only the store's statements differ.
//
//	go test -run '^$' -bench StoreQueryExecMode -count 5 ./pgstore/
func BenchmarkStoreQueryExecMode(b *testing.B) {
	for _, m := range []struct {
		name string
		mode pgx.QueryExecMode
	}{
		{"cache_statement", pgx.QueryExecModeCacheStatement},
		{"cache_describe", pgx.QueryExecModeCacheDescribe},
		{"exec", pgx.QueryExecModeExec},
	} {
		b.Run(m.name, func(b *testing.B) {
			benchStoreMode(b, m.mode)
		})
	}
}

func benchStoreMode(b *testing.B, mode pgx.QueryExecMode) {
	ctx := context.Background()
	pool := migratedPool(b)
	s := pgstore.New(pool, pgstore.Options{QueryExecMode: mode})
	p := func(key string) idemdriver.ClaimParams {
		return idemdriver.ClaimParams{User: "bench", Key: key, Fingerprint: "fp", Method: http.MethodPost, Path: "/v1/orders",
			Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"n":1}`), Lease: time.Minute, TTL: time.Hour}
	}
	create := func(key string) {
		c, err := s.Claim(ctx, p(key))
		if err != nil || c.Lease == nil {
			b.Fatalf("Claim: %+v, %v", c, err)
		}
		tx, err := s.Begin(ctx, c.Lease)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := tx.(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO effects (name) VALUES ($1)`, pgx.QueryExecModeCacheStatement, key); err != nil {
			b.Fatal(err)
		}
		if err := tx.Complete(ctx, &idemdriver.Response{Status: 201, Header: http.Header{"Location": {"/v1/orders/1"}}, Body: []byte(`{"id":"o1"}`)}); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("create", func(b *testing.B) {
		for i := 0; b.Loop(); i++ {
			create(fmt.Sprintf("c-%d-%d", time.Now().UnixNano(), i))
		}
	})
	create("replayed")
	b.Run("replay", func(b *testing.B) {
		for b.Loop() {
			if c, err := s.Claim(ctx, p("replayed")); err != nil || c.Response == nil {
				b.Fatalf("replay: %+v, %v", c, err)
			}
		}
	})
}
