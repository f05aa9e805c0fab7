package idemgrpc_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemgrpc"
	"github.com/idem-go/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// ExampleCompleterFuncs finishes a call that its client gave up on: the
// first attempt failed with a retryable code (as a server that dies
// mid-call leaves its key once the lease ran out), and a completer with
// the service's functions runs it again; the client's retry, later,
// gets the completer's answer replayed.
func ExampleCompleterFuncs() {
	store := memstore.New(memstore.Options{}) // or pgstore, sqlitestore; redisfront in front
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	opts := idemgrpc.Options{
		Methods: map[string]func() proto.Message{
			"/example.Orders/Create": func() proto.Message { return new(wrapperspb.StringValue) },
		},
		User:   func(ctx context.Context) (string, error) { return "alice", nil },
		Logger: quiet,
	}

	gatewayUp := false
	create := func(ctx context.Context, sku *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if !gatewayUp {
			return nil, status.Error(codes.Unavailable, "payment gateway down")
		}
		// No metadata in a re-drive: the user is the lease's.
		l, _ := idem.LeaseFromContext(ctx)
		return wrapperspb.String(fmt.Sprintf("order of %s for %s", sku.GetValue(), l.User)), nil
	}

	// The completer runs each opted-in method of the service (ordersDesc,
	// generated code's Orders_ServiceDesc) with the implementation.
	completer := idem.NewCompleter(store, nil, idem.CompleterOptions{
		Funcs:  idemgrpc.CompleterFuncs(&ordersDesc, create, opts),
		Logger: quiet,
	})

	srv := grpc.NewServer(grpc.UnaryInterceptor(idemgrpc.UnaryServerInterceptor(store, opts)))
	srv.RegisterService(&ordersDesc, create)
	lis := bufconn.Listen(1 << 20)
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()
	conn, err := grpc.NewClient("passthrough:///orders",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
	ctx := metadata.AppendToOutgoingContext(context.Background(), idemgrpc.KeyMetadata, "order-1")

	var id wrapperspb.StringValue
	err = conn.Invoke(ctx, "/example.Orders/Create", wrapperspb.String("SKU-1"), &id)
	fmt.Println("call:", status.Code(err))

	gatewayUp = true
	st, err := completer.RunOnce(context.Background()) // Run(ctx) in a service
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("completer finished:", st.Completed)

	var header metadata.MD
	if err := conn.Invoke(ctx, "/example.Orders/Create", wrapperspb.String("SKU-1"), &id, grpc.Header(&header)); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("retry: %s (replayed: %v)\n", id.GetValue(), header.Get(idemgrpc.ReplayedMetadata))
	// Output:
	// call: Unavailable
	// completer finished: 1
	// retry: order of SKU-1 for alice (replayed: [true])
}
