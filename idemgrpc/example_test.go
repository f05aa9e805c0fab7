package idemgrpc_test

import (
	"context"
	"fmt"
	"log"
	"net"

	"github.com/idem-go/idem/idemgrpc"
	"github.com/idem-go/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// A method of a service without generated code: Orders.Create takes a
// StringValue (the SKU) and answers a StringValue (the order's id).
// Generated code (protoc-gen-go-grpc) gives the same grpc.ServiceDesc.
var ordersDesc = grpc.ServiceDesc{
	ServiceName: "example.Orders",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Create",
		Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			in := new(wrapperspb.StringValue)
			if err := dec(in); err != nil {
				return nil, err
			}
			create := srv.(func(context.Context, *wrapperspb.StringValue) (*wrapperspb.StringValue, error))
			return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: "/example.Orders/Create"},
				func(ctx context.Context, req any) (any, error) { return create(ctx, req.(*wrapperspb.StringValue)) })
		},
	}},
}

func Example() {
	store := memstore.New(memstore.Options{}) // or pgstore, sqlitestore; redisfront in front

	orders := 0
	create := func(ctx context.Context, sku *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		// Write through the call's transaction (memstore.FromContext,
		// pgstore.FromContext, …): it commits with the stored answer.
		if _, err := memstore.FromContext(ctx); err != nil {
			return nil, err
		}
		orders++
		return wrapperspb.String(fmt.Sprintf("order %d of %s", orders, sku.GetValue())), nil
	}

	srv := grpc.NewServer(grpc.UnaryInterceptor(idemgrpc.UnaryServerInterceptor(store, idemgrpc.Options{
		// The methods made idempotent, each with its response type.
		Methods: map[string]func() proto.Message{
			"/example.Orders/Create": func() proto.Message { return new(wrapperspb.StringValue) },
		},
		// The authenticated caller: a key belongs to one user.
		User: func(ctx context.Context) (string, error) { return "alice", nil },
	})))
	srv.RegisterService(&ordersDesc, create)
	lis := bufconn.Listen(1 << 20)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	conn, err := grpc.NewClient("passthrough:///orders",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		// One key per call, kept across gRPC's retries.
		grpc.WithUnaryInterceptor(idemgrpc.UnaryClientInterceptor(idemgrpc.ClientOptions{})))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()

	// The caller's own retries of one operation share its key (WithKey).
	ctx := idemgrpc.WithKey(context.Background(), idemgrpc.NewKey())
	for range 2 {
		var id wrapperspb.StringValue
		var header metadata.MD
		if err := conn.Invoke(ctx, "/example.Orders/Create", wrapperspb.String("SKU-1"), &id, grpc.Header(&header)); err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%s (replayed: %v)\n", id.GetValue(), header.Get(idemgrpc.ReplayedMetadata))
	}
	// Output:
	// order 1 of SKU-1 (replayed: [])
	// order 1 of SKU-1 (replayed: [true])
}
