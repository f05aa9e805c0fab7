package idemgrpc_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/idem-go/idem/idemgrpc/idemconnect"
	"github.com/idem-go/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
)

// abortedRetryConfig retries the test service's calls answered Aborted.
const abortedRetryConfig = `{"methodConfig": [{
	"name": [{"service": "` + serviceName + `"}],
	"retryPolicy": {
		"maxAttempts": 5,
		"initialBackoff": "0.05s",
		"maxBackoff": "0.2s",
		"backoffMultiplier": 2,
		"retryableStatusCodes": ["ABORTED"]
	}
}]}`

// attempts is a Connect interceptor counting the calls that reach it.
type attempts struct{ n chan struct{} }

func (a attempts) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		a.n <- struct{}{}
		return next(ctx, req)
	}
}

func (a attempts) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a attempts) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// TestConnectInFlightToGRPCClient: a grpc-go client of a Connect server
// not wrapped in TrailersOnly, with a retry policy on Aborted, calling
// while its key is in flight. Without InFlightWait it gets Aborted with
// retry-after in the trailer and a RetryInfo detail, once: the answer
// comes after a response header of its own, which gRPC's retry policy
// does not retry; its own retry with the key then replays. With
// InFlightWait the call waits for the one in flight and replays it.
// (TestConnectInFlightRetriedByGRPCPolicy: the same behind TrailersOnly,
// retried by the policy.)
func TestConnectInFlightToGRPCClient(t *testing.T) {
	for _, wait := range []time.Duration{0, 10 * time.Second} {
		t.Run("InFlightWait="+wait.String(), func(t *testing.T) {
			release, started := make(chan struct{}), make(chan struct{}, 1)
			var once sync.Once
			t.Cleanup(func() { once.Do(func() { close(release) }) })
			svc := &service{handle: func(context.Context, *structpb.Struct) (*structpb.Struct, error) {
				started <- struct{}{}
				<-release
				return mustStruct(t, map[string]any{"id": "ord_1"}), nil
			}}
			opts := connectOptions()
			opts.InFlightWait = wait
			seen := attempts{n: make(chan struct{}, 100)}
			srv := serveConnect(t, svc, seen, idemconnect.NewInterceptor(memstore.New(memstore.Options{}), opts))
			conn, err := grpc.NewClient("passthrough:///"+srv.addr,
				grpc.WithTransportCredentials(insecure.NewCredentials()),
				grpc.WithDefaultServiceConfig(abortedRetryConfig))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { conn.Close() })
			ctx := t.Context()

			first := make(chan answer, 1)
			go func() { first <- call(ctx, srv.creator(createMethod), "in-flight", order(t, "SKU-1")) }()
			<-started
			<-seen.n
			second := make(chan result, 1)
			go func() { second <- create(ctx, conn, "in-flight", order(t, "SKU-1")) }()
			<-seen.n
			if wait == 0 {
				r := <-second
				a := grpcAnswer(r)
				if a.code != codes.Aborted || a.retryAfter == "" || len(status.Convert(r.err).Details()) != 1 {
					t.Errorf("in flight: %v, retry-after %q, details %v; want Aborted, retry-after, RetryInfo", r.err, a.retryAfter, status.Convert(r.err).Details())
				}
				select {
				case <-seen.n:
					t.Error("gRPC's retry policy retried an Aborted answer sent after a header: connect-go now sends Trailers-Only itself (see TrailersOnly's documentation)")
				case <-time.After(300 * time.Millisecond):
				}
			}
			once.Do(func() { close(release) })
			if a := <-first; a.err != nil || a.replayed {
				t.Fatalf("first call: %v, replayed %v", a.err, a.replayed)
			}
			r := create(ctx, conn, "in-flight", order(t, "SKU-1"))
			if wait > 0 {
				r = <-second
			}
			if r.err != nil || !r.replayed() || r.resp.Fields["id"].GetStringValue() != "ord_1" {
				t.Errorf("gRPC client's repeat: %v, replayed %v, %v", r.err, r.replayed(), r.resp)
			}
			if got := svc.runs.Load(); got != 1 {
				t.Errorf("handler ran %d times, want 1", got)
			}
		})
	}
}

// TestConnectReplayedErrorHeader: a stored error replayed by the Connect
// interceptor carries idempotent-replayed: true in the response header,
// as idemgrpc's does, through the gRPC protocol as through Connect's.
func TestConnectReplayedErrorHeader(t *testing.T) {
	svc := &service{handle: func(context.Context, *structpb.Struct) (*structpb.Struct, error) {
		return nil, transports[1].fail(t, codes.FailedPrecondition, "card declined", "CARD_DECLINED")
	}}
	srv := serveConnect(t, svc, idemconnect.NewInterceptor(memstore.New(memstore.Options{}), connectOptions()))
	ctx := t.Context()
	conn := srv.grpcConn(t)
	for i := range 2 {
		r := create(ctx, conn, "declined", order(t, "SKU-1"))
		if status.Code(r.err) != codes.FailedPrecondition || r.replayed() != (i == 1) {
			t.Errorf("gRPC call %d: %v, header %v, trailer %v; want FailedPrecondition, replayed %v in the header", i, r.err, r.header, r.trailer, i == 1)
		}
	}
	for _, c := range []*connect.Client[structpb.Struct, structpb.Struct]{srv.creator(createMethod), srv.creator(createMethod, connect.WithGRPC())} {
		if a := call(ctx, c, "declined", order(t, "SKU-1")); a.code != codes.FailedPrecondition || !a.replayed {
			t.Errorf("Connect client: %v, replayed %v", a.err, a.replayed)
		}
	}
	if got := svc.runs.Load(); got != 1 {
		t.Errorf("handler ran %d times, want 1", got)
	}
}
