package idemgrpc_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/idem-go/idem/idemgrpc"
	"github.com/idem-go/idem/idemgrpc/idemconnect"
	"github.com/idem-go/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// retryAborted is a grpc-go service config retrying the test service's
// calls answered ABORTED.
const retryAborted = `{"methodConfig": [{"name": [{"service": "` + serviceName + `"}],
	"retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.01s", "maxBackoff": "0.1s",
		"backoffMultiplier": 2, "retryableStatusCodes": ["ABORTED"]}}]}`

// serveH2C serves h over HTTP/1.1 and unencrypted HTTP/2 and returns a
// grpc-go connection to it with a retry policy for ABORTED.
func serveH2C(t *testing.T, h http.Handler) (*grpc.ClientConn, string) {
	t.Helper()
	srv := httptest.NewUnstartedServer(h)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	conn, err := grpc.NewClient("passthrough:///"+srv.Listener.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithDefaultServiceConfig(retryAborted))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn, srv.URL
}

// A Connect handler's error to a grpc-go client is retried by its retry
// policy only behind TrailersOnly; the error's metadata reaches the
// client's trailer either way, and answers with a message, and calls of
// the Connect protocol, are as connect-go makes them.
func TestTrailersOnlyLetsGRPCRetry(t *testing.T) {
	for _, wrapped := range []bool{false, true} {
		var attempts atomic.Int64
		h := connect.NewUnaryHandler(createMethod, func(_ context.Context, req *connect.Request[structpb.Struct]) (*connect.Response[structpb.Struct], error) {
			if attempts.Add(1) < 3 {
				err := connect.NewError(connect.CodeAborted, nil)
				err.Meta().Set("retry-after", "1")
				return nil, err
			}
			resp := connect.NewResponse(req.Msg)
			resp.Header().Set("x-answer", "header")
			resp.Trailer().Set("x-answer-trailer", "trailer")
			return resp, nil
		})
		var handler http.Handler = h
		if wrapped {
			handler = idemconnect.TrailersOnly(h)
		}
		conn, url := serveH2C(t, handler)
		req := &structpb.Struct{Fields: map[string]*structpb.Value{"n": structpb.NewNumberValue(1)}}
		var header, trailer metadata.MD
		out := new(structpb.Struct)
		err := conn.Invoke(context.Background(), createMethod, req, out, grpc.Header(&header), grpc.Trailer(&trailer))
		if !wrapped {
			// The policy never retries: the answer came committed.
			if status.Code(err) != codes.Aborted || attempts.Load() != 1 {
				t.Fatalf("unwrapped: %v after %d attempts, want Aborted after 1", err, attempts.Load())
			}
			if got := trailer.Get("retry-after"); len(got) != 1 || got[0] != "1" {
				t.Errorf("unwrapped: retry-after trailer %q", got)
			}
			continue
		}
		if err != nil || attempts.Load() != 3 {
			t.Fatalf("wrapped: %v after %d attempts, want the answer after 3", err, attempts.Load())
		}
		if !proto.Equal(out, req) || len(header.Get("x-answer")) != 1 || len(trailer.Get("x-answer-trailer")) != 1 {
			t.Errorf("wrapped answer %v, header %v, trailer %v", out, header, trailer)
		}

		// A lone Aborted, not retried: its metadata and details arrive.
		attempts.Store(-10)
		trailer = nil
		err = conn.Invoke(context.Background(), createMethod, req, out, grpc.Trailer(&trailer))
		if status.Code(err) != codes.Aborted {
			t.Fatalf("wrapped, failing: %v, want Aborted", err)
		}
		if got := trailer.Get("retry-after"); len(got) != 1 || got[0] != "1" {
			t.Errorf("wrapped: retry-after %q in the Trailers-Only answer", got)
		}

		// The Connect protocol passes through.
		attempts.Store(-10)
		c := connect.NewClient[structpb.Struct, structpb.Struct](http.DefaultClient, url+createMethod)
		_, err = c.CallUnary(context.Background(), connect.NewRequest(req))
		var ce *connect.Error
		if !errors.As(err, &ce) || ce.Code() != connect.CodeAborted || ce.Meta().Get("retry-after") != "1" {
			t.Errorf("Connect protocol: %v, want Aborted with retry-after", err)
		}
	}
}

// The idemconnect interceptor behind TrailersOnly: fifty grpc-go calls
// with one key at once, their retry policy retrying Aborted, all get the
// one execution's answer.
func TestConnectInFlightRetriedByGRPCPolicy(t *testing.T) {
	svc := &service{handle: func(ctx context.Context, req *structpb.Struct) (*structpb.Struct, error) {
		time.Sleep(20 * time.Millisecond)
		return req, nil
	}}
	opts := connectOptions()
	h := connect.NewUnaryHandler(createMethod, func(ctx context.Context, req *connect.Request[structpb.Struct]) (*connect.Response[structpb.Struct], error) {
		resp, err := svc.call(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(resp), nil
	}, connect.WithInterceptors(idemconnect.NewInterceptor(memstore.New(memstore.Options{}), opts)))
	conn, _ := serveH2C(t, idemconnect.TrailersOnly(h))
	req := &structpb.Struct{Fields: map[string]*structpb.Value{"order": structpb.NewStringValue("o-1")}}
	const n = 50
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			ctx := metadata.AppendToOutgoingContext(context.Background(), idemgrpc.KeyMetadata, "storm")
			errs[i] = conn.Invoke(ctx, createMethod, req, new(structpb.Struct))
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("call %d: %v", i, err)
		}
	}
	if got := svc.runs.Load(); got != 1 {
		t.Errorf("handler runs = %d, want 1", got)
	}
}

// A streaming handler that sends its headers alone (connect-go's
// stream.Send(nil)) and then waits for the client's message gets them
// to the client at once behind TrailersOnly: a grpc-go client waiting
// for the header before it sends is not left waiting for ever.
func TestTrailersOnlySendsStreamHeadersAtOnce(t *testing.T) {
	const chat = "/" + serviceName + "/Chat"
	h := connect.NewBidiStreamHandler(chat, func(_ context.Context, s *connect.BidiStream[structpb.Struct, structpb.Struct]) error {
		s.ResponseHeader().Set("x-ready", "yes")
		if err := s.Send(nil); err != nil { // the header alone
			return err
		}
		msg, err := s.Receive()
		if err != nil {
			return err
		}
		return s.Send(msg)
	})
	conn, _ := serveH2C(t, idemconnect.TrailersOnly(h))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, chat)
	if err != nil {
		t.Fatal(err)
	}
	md, err := st.Header()
	if err != nil || len(md.Get("x-ready")) != 1 {
		t.Fatalf("header %v, %v; want x-ready before the client sends", md, err)
	}
	in := &structpb.Struct{Fields: map[string]*structpb.Value{"n": structpb.NewNumberValue(1)}}
	if err := st.SendMsg(in); err != nil {
		t.Fatal(err)
	}
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	out := new(structpb.Struct)
	if err := st.RecvMsg(out); err != nil || !proto.Equal(out, in) {
		t.Fatalf("echo %v, %v", out, err)
	}
}
