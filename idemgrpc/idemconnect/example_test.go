package idemconnect_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"

	"connectrpc.com/connect"
	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/idemgrpc/idemconnect"
	"github.com/idem-go/idem/memstore"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func Example() {
	store := memstore.New(memstore.Options{}) // or pgstore, sqlitestore; redisfront in front

	// A procedure without generated code: Orders.Create takes a
	// StringValue (the SKU) and answers a StringValue (the order's id).
	// Generated code gives the same handler and its …Procedure constant.
	const procedure = "/example.Orders/Create"
	orders := 0
	create := func(ctx context.Context, req *connect.Request[wrapperspb.StringValue]) (*connect.Response[wrapperspb.StringValue], error) {
		// Write through the call's transaction (memstore.FromContext,
		// pgstore.FromContext, …): it commits with the stored answer.
		if _, err := memstore.FromContext(ctx); err != nil {
			return nil, err
		}
		orders++
		return connect.NewResponse(wrapperspb.String(fmt.Sprintf("order %d of %s", orders, req.Msg.GetValue()))), nil
	}

	mux := http.NewServeMux()
	mux.Handle(procedure, connect.NewUnaryHandler(procedure, create,
		connect.WithInterceptors(idemconnect.NewInterceptor(store, idemconnect.Options{
			// The procedures made idempotent, each with its response type.
			Methods: map[string]idemconnect.Method{
				procedure: idemconnect.Response[wrapperspb.StringValue](),
			},
			// The authenticated caller: a key belongs to one user.
			User: func(ctx context.Context, req connect.AnyRequest) (string, error) { return "alice", nil },
		}))))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	orderClient := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](srv.Client(), srv.URL+procedure)
	// The caller's own retries of one operation share its key.
	key := client.NewKey()
	for range 2 {
		req := connect.NewRequest(wrapperspb.String("SKU-1"))
		req.Header().Set(idemconnect.KeyHeader, key)
		resp, err := orderClient.CallUnary(context.Background(), req)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s (replayed: %q)\n", resp.Msg.GetValue(), resp.Header().Get(idemconnect.ReplayedHeader))
	}
	// Output:
	// order 1 of SKU-1 (replayed: "")
	// order 1 of SKU-1 (replayed: "true")
}
