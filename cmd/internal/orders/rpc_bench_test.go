package orders

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// BenchmarkCreateOrderTransports: one order's create and its replay,
// through POST /v1/orders (HTTP/1.1, Go's client) and through CreateOrder
// over grpc-go, Connect, connect-go's gRPC and gRPC-Web, on the test
// bundle (SQLite, the fake gateway, one process). The HTTP rows are the
// baseline: the RPC rows' ratio to them is what running each call through
// the HTTP chain and back, plus the protocol's own encoding, adds.
func BenchmarkCreateOrderTransports(b *testing.B) {
	// No per-user rate limit: a replay is quicker than its 1,000 a second.
	bundle := setup(b, func(o *setupOptions) { o.userRateEvery = -1 })
	tok := bundle.token(b, "alice")
	ctx := context.Background()
	run := func(b *testing.B, replay bool, send func(key string) error) {
		if replay {
			if err := send("replayed"); err != nil {
				b.Fatal(err)
			}
		}
		i := 0
		for b.Loop() {
			key := "replayed"
			if !replay {
				i++
				key = fmt.Sprintf("%s-%d", b.Name(), i)
			}
			if err := send(key); err != nil {
				b.Fatal(err)
			}
		}
	}
	for _, replay := range []bool{false, true} {
		path := "create"
		if replay {
			path = "replay"
		}
		b.Run(path+"/http", func(b *testing.B) {
			run(b, replay, func(key string) error {
				req, _ := http.NewRequest("POST", bundle.srv.URL+"/v1/orders", strings.NewReader(orderBody))
				req.Header.Set("Authorization", "Bearer "+tok)
				req.Header.Set("Idempotency-Key", b.Name()+key)
				req.Header.Set("Content-Type", "application/json")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					return err
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusCreated {
					return fmt.Errorf("status %d", resp.StatusCode)
				}
				return nil
			})
		})
		for _, c := range rpcClients(b, bundle) {
			b.Run(path+"/"+c.name, func(b *testing.B) {
				run(b, replay, func(key string) error {
					if r := c.call(ctx, tok, b.Name()+key, orderRequest()); r.code != 0 {
						return fmt.Errorf("%s", r)
					}
					return nil
				})
			})
		}
	}
}
