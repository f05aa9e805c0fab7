package idemgrpc_test

import (
	"context"
	"testing"

	"github.com/idem-go/idem/idemgrpc"
	"github.com/idem-go/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// callCreate calls icpt as grpc-go calls a unary interceptor for Create,
// with key in the incoming metadata, req and handler.
func callCreate(icpt grpc.UnaryServerInterceptor, key string, req any, handler grpc.UnaryHandler) (any, error) {
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(idemgrpc.KeyMetadata, key))
	return icpt(ctx, req, &grpc.UnaryServerInfo{FullMethod: createMethod}, handler)
}

// TestReplayOfAnotherResponseTypeIsInternal: a server whose
// Options.Methods builds another response type than the one stored
// under the key (another version of the service, or another server on
// the same store) answers Internal rather than the stored bytes read as
// its own type.
func TestReplayOfAnotherResponseTypeIsInternal(t *testing.T) {
	store := memstore.New(memstore.Options{})
	structs := idemgrpc.UnaryServerInterceptor(store, testOptions())
	opts := testOptions()
	opts.Methods = map[string]func() proto.Message{createMethod: func() proto.Message { return new(wrapperspb.StringValue) }}
	strs := idemgrpc.UnaryServerInterceptor(store, opts)

	req := order(t, "SKU-1")
	if _, err := callCreate(structs, "typed", req, func(context.Context, any) (any, error) {
		return mustStruct(t, map[string]any{"id": "ord_1", "n": 3}), nil
	}); err != nil {
		t.Fatal(err)
	}
	ran := false
	resp, err := callCreate(strs, "typed", req, func(context.Context, any) (any, error) {
		ran = true
		return wrapperspb.String("ord_2"), nil
	})
	if status.Code(err) != codes.Internal || ran {
		t.Errorf("replay into a StringValue of a stored Struct: %v (%v), handler ran %v; want Internal, no run", resp, err, ran)
	}
	// The server that stored it still replays it.
	resp, err = callCreate(structs, "typed", req, func(context.Context, any) (any, error) { return nil, nil })
	if s, ok := resp.(*structpb.Struct); err != nil || !ok || s.Fields["id"].GetStringValue() != "ord_1" {
		t.Errorf("replay by the storing server: %v, %v", resp, err)
	}
}

// okStatusError is an error whose gRPC status is OK.
type okStatusError struct{}

func (okStatusError) Error() string              { return "not an error" }
func (okStatusError) GRPCStatus() *status.Status { return status.New(codes.OK, "fine") }

// TestErrorWithOKStatusIsNotStored: a handler's error whose status is OK
// is not a final answer (there is no response to replay): it is stored
// as nothing, its writes roll back, and the call runs again.
func TestErrorWithOKStatusIsNotStored(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		svc := &service{}
		svc.handle = func(ctx context.Context, _ *structpb.Struct) (*structpb.Struct, error) {
			if err := h.write(ctx, "okerr"); err != nil {
				return nil, err
			}
			if svc.runs.Load() == 1 {
				return nil, okStatusError{}
			}
			return mustStruct(t, map[string]any{"id": "ord_1"}), nil
		}
		conn := serve(t, svc, []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(h.store, testOptions())})
		if r := create(t.Context(), conn, "okerr", order(t, "SKU-1")); r.err == nil || r.replayed() {
			t.Fatalf("first call: %v, replayed %v; want an error", r.err, r.replayed())
		}
		if got := h.count(t, "okerr"); got != 0 {
			t.Errorf("the failed attempt's write committed %d times", got)
		}
		r := create(t.Context(), conn, "okerr", order(t, "SKU-1"))
		if r.err != nil || r.replayed() || r.resp.Fields["id"].GetStringValue() != "ord_1" {
			t.Errorf("retry: %v, replayed %v, %v; want a new run's answer", r.err, r.replayed(), r.resp)
		}
		if got := h.count(t, "okerr"); got != 1 {
			t.Errorf("writes committed %d times, want 1", got)
		}
	})
}

// TestHandlerContextErrorKeepsItsCode: a handler returning ctx's error
// is answered Canceled or DeadlineExceeded, as gRPC and Connect answer
// it, and so judged by Options.Stored: a table that stores Unknown
// does not store it, and a table that stores DeadlineExceeded replays
// DeadlineExceeded.
func TestHandlerContextErrorKeepsItsCode(t *testing.T) {
	for _, c := range []struct {
		stored     codes.Code
		wantStored bool
	}{{codes.Unknown, false}, {codes.DeadlineExceeded, true}} {
		t.Run(c.stored.String(), func(t *testing.T) {
			svc := &service{handle: func(context.Context, *structpb.Struct) (*structpb.Struct, error) {
				return nil, context.DeadlineExceeded
			}}
			opts := testOptions()
			opts.Stored = func(code codes.Code) bool { return code == c.stored || idemgrpc.StoredCode(code) }
			conn := serve(t, svc, []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(memstore.New(memstore.Options{}), opts)})
			for i := range 2 {
				r := create(t.Context(), conn, "ctxerr", order(t, "SKU-1"))
				if status.Code(r.err) != codes.DeadlineExceeded || r.replayed() != (c.wantStored && i == 1) {
					t.Errorf("call %d: %v, replayed %v; want DeadlineExceeded, replayed %v", i, r.err, r.replayed(), c.wantStored && i == 1)
				}
			}
			if want := map[bool]int64{true: 1, false: 2}[c.wantStored]; svc.runs.Load() != want {
				t.Errorf("handler ran %d times, want %d", svc.runs.Load(), want)
			}
		})
	}
}

// TestUnknownFieldsLeaveFingerprintAlone: the fingerprint is the request
// as the server's type reads it, without the fields it does not know,
// whose bytes are the client's own (not deterministic: a map's entries
// come in any order). The same request with its unknown fields in
// another order, or others, replays; one that differs in a known field
// is refused.
func TestUnknownFieldsLeaveFingerprintAlone(t *testing.T) {
	concat := func(parts ...*structpb.Struct) []byte {
		var b []byte
		for _, p := range parts {
			b = append(b, encode(t, p)...)
		}
		return b
	}
	a, b := mustStruct(t, map[string]any{"a": 1}), mustStruct(t, map[string]any{"b": 2})
	// Struct encodings read as an Empty, which knows no field: every
	// entry is an unknown field, kept in the order it came in.
	icpt := idemgrpc.UnaryServerInterceptor(memstore.New(memstore.Options{}), testOptions())
	var runs int
	handler := func(context.Context, any) (any, error) { runs++; return new(structpb.Struct), nil }
	for i, raw := range [][]byte{concat(a, b), concat(b, a), concat(b)} {
		req := new(emptypb.Empty)
		if err := proto.Unmarshal(raw, req); err != nil {
			t.Fatal(err)
		}
		if _, err := callCreate(icpt, "unknown", req, handler); err != nil {
			t.Errorf("request %d: %v, want its replay", i, err)
		}
	}
	if runs != 1 {
		t.Errorf("handler ran %d times, want 1", runs)
	}
	// Known fields count: Struct's entries, whatever their order on the
	// wire.
	for i, raw := range [][]byte{concat(a, b), concat(b, a)} {
		req := new(structpb.Struct)
		if err := proto.Unmarshal(raw, req); err != nil {
			t.Fatal(err)
		}
		if _, err := callCreate(icpt, "known", req, handler); err != nil {
			t.Errorf("known request %d: %v", i, err)
		}
	}
	if _, err := callCreate(icpt, "known", b, handler); status.Code(err) != codes.InvalidArgument {
		t.Errorf("another known request: %v, want InvalidArgument", err)
	}
	if runs != 2 {
		t.Errorf("handler ran %d times, want 2", runs)
	}
}
