package ordersapp

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem/cmd/internal/api/ordersv1"
	"github.com/idem-go/idem/cmd/internal/api/ordersv1/ordersv1connect"
	"github.com/idem-go/idem/idemgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
)

// rpcOrder is orderBody(i) as a message.
func rpcOrder(i int) *ordersv1.CreateOrderRequest {
	return &ordersv1.CreateOrderRequest{
		Items:    []*ordersv1.Item{{Sku: fmt.Sprintf("SKU-%d", i%7), Quantity: int64(1 + i%3), UnitPrice: int64(100 + i)}},
		Currency: "EUR",
	}
}

// grpcConn is a grpc-go connection to base (http://host:port) with
// idemgrpc's client interceptor (one key per call, WithKey's) and, if
// retry, a retry policy for the answers a retry with the same key
// settles: a key in flight (ABORTED) and a server gone (UNAVAILABLE).
func grpcConn(t *testing.T, base string, retry bool) *grpc.ClientConn {
	t.Helper()
	const policy = `{"methodConfig": [{"name": [{"service": "orders.v1.OrderService"}],
		"retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.2s", "maxBackoff": "2s",
			"backoffMultiplier": 2, "retryableStatusCodes": ["ABORTED", "UNAVAILABLE"]}}]}`
	opts := []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idemgrpc.UnaryClientInterceptor(idemgrpc.ClientOptions{})),
	}
	if retry {
		opts = append(opts, grpc.WithDefaultServiceConfig(policy))
	}
	conn, err := grpc.NewClient("passthrough:///"+strings.TrimPrefix(base, "http://"), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// createOrderRPC calls CreateOrder on conn as user with key.
func createOrderRPC(ctx context.Context, conn *grpc.ClientConn, user, key string, i int) (*ordersv1.Order, error) {
	tok, err := issue(user)
	if err != nil {
		return nil, err
	}
	ctx = metadata.AppendToOutgoingContext(idemgrpc.WithKey(ctx, key), "authorization", "Bearer "+tok)
	out := new(ordersv1.Order)
	return out, conn.Invoke(ctx, ordersv1connect.OrderServiceCreateOrderProcedure, rpcOrder(i), out)
}

// kill -9 one of two instances while 50 CreateOrder calls over gRPC are
// in flight, then, after the lease, retry each with its key on the other
// instance: half over gRPC, half over HTTP (one key space). One order and
// one payment per key, and the audit finds every invariant.
func TestCrashMidRPCThenRetry(t *testing.T) {
	c := newChain(t, 2, []string{"--latency", "1s"}, "--key-lease", "2s")
	// No retry policy: the calls end with the instance.
	dying := grpcConn(t, c.bases[0], false)
	keys := crashInFlightVia(t, c, "rpc", func(i int, key string) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = createOrderRPC(ctx, dying, "crash-user", key, i) // dies with the instance
	})
	time.Sleep(2 * time.Second) // not waiting for an outcome: the wall clock of the processes and PostgreSQL passes the killed attempts' lease (2s)
	conn := grpcConn(t, c.bases[1], true)
	hc := retrying()
	var wg sync.WaitGroup
	for i, k := range keys {
		wg.Go(func() {
			if i%2 == 1 {
				if s, err := post(hc, c.bases[1], "crash-user", k, i); s != http.StatusCreated {
					t.Errorf("HTTP retry of %s: %d %v", k, s, err)
				}
				return
			}
			// The client's own retries of one operation: the same key
			// (the policy's own attempts keep it too).
			var err error
			for range 10 {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				var o *ordersv1.Order
				o, err = createOrderRPC(ctx, conn, "crash-user", k, i)
				cancel()
				if err == nil {
					if o.GetUserId() != "crash-user" || o.GetTotal() != rpcOrder(i).GetItems()[0].GetQuantity()*rpcOrder(i).GetItems()[0].GetUnitPrice() {
						t.Errorf("gRPC retry of %s: order %v", k, o)
					}
					return
				}
				time.Sleep(500 * time.Millisecond) // the policy's attempts ran out; a caller's own backoff
			}
			t.Errorf("gRPC retry of %s: %v", k, err)
		})
	}
	wg.Wait()
	c.wantOneOrderAndPaymentEach(t, "crash mid-RPC then retry", len(keys))
}
