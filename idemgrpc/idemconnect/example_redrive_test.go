package idemconnect_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"

	"connectrpc.com/connect"
	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemgrpc/idemconnect"
	"github.com/idem-go/idem/memstore"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// ExampleCompleterFunc finishes a call that its client gave up on: the
// first attempt failed with a retryable code (as a server that dies
// mid-call leaves its key once the lease ran out), and a completer with
// the procedure's function runs it again; the client's retry, later,
// gets the completer's answer replayed.
func ExampleCompleterFunc() {
	store := memstore.New(memstore.Options{}) // or pgstore, sqlitestore; redisfront in front
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	const procedure = "/example.Orders/Create"
	opts := idemconnect.Options{
		Methods: map[string]idemconnect.Method{procedure: idemconnect.Response[wrapperspb.StringValue]()},
		User:    func(ctx context.Context, req connect.AnyRequest) (string, error) { return "alice", nil },
		Logger:  quiet,
	}

	gatewayUp := false
	create := func(ctx context.Context, req *connect.Request[wrapperspb.StringValue]) (*connect.Response[wrapperspb.StringValue], error) {
		if !gatewayUp {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("payment gateway down"))
		}
		// No header in a re-drive: the user is the lease's.
		l, _ := idem.LeaseFromContext(ctx)
		return connect.NewResponse(wrapperspb.String(fmt.Sprintf("order of %s for %s", req.Msg.GetValue(), l.User))), nil
	}

	// The completer runs the procedure's handler, by its name.
	completer := idem.NewCompleter(store, nil, idem.CompleterOptions{
		Funcs:  map[string]idem.DoFunc{procedure: idemconnect.CompleterFunc(procedure, create, opts)},
		Logger: quiet,
	})

	mux := http.NewServeMux()
	mux.Handle(procedure, connect.NewUnaryHandler(procedure, create,
		connect.WithInterceptors(idemconnect.NewInterceptor(store, opts))))
	srv := httptest.NewServer(mux)
	defer srv.Close()
	orders := connect.NewClient[wrapperspb.StringValue, wrapperspb.StringValue](srv.Client(), srv.URL+procedure)
	newCall := func() *connect.Request[wrapperspb.StringValue] {
		req := connect.NewRequest(wrapperspb.String("SKU-1"))
		req.Header().Set(idemconnect.KeyHeader, "order-1")
		return req
	}

	_, err := orders.CallUnary(context.Background(), newCall())
	fmt.Println("call:", connect.CodeOf(err))

	gatewayUp = true
	st, err := completer.RunOnce(context.Background()) // Run(ctx) in a service
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("completer finished:", st.Completed)

	resp, err := orders.CallUnary(context.Background(), newCall())
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("retry: %s (replayed: %q)\n", resp.Msg.GetValue(), resp.Header().Get(idemconnect.ReplayedHeader))
	// Output:
	// call: unavailable
	// completer finished: 1
	// retry: order of SKU-1 for alice (replayed: "true")
}
