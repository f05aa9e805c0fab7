package idemgrpc_test

import (
	"context"
	"sync"
	"testing"

	"github.com/idem-go/idem/idemgrpc"
	"github.com/idem-go/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
)

// retryConfig retries the test service's calls answered Unavailable.
const retryConfig = `{"methodConfig": [{
	"name": [{"service": "` + serviceName + `"}],
	"retryPolicy": {
		"maxAttempts": 4,
		"initialBackoff": "0.01s",
		"maxBackoff": "0.05s",
		"backoffMultiplier": 2,
		"retryableStatusCodes": ["UNAVAILABLE"]
	}
}]}`

// keyRecorder is a server interceptor that records the key of every
// attempt that reaches the server.
type keyRecorder struct {
	mu   sync.Mutex
	keys []string
}

func (k *keyRecorder) intercept(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	k.mu.Lock()
	k.keys = append(k.keys, md.Get(idemgrpc.KeyMetadata)...)
	if len(md.Get(idemgrpc.KeyMetadata)) == 0 {
		k.keys = append(k.keys, "")
	}
	k.mu.Unlock()
	return handler(ctx, req)
}

func (k *keyRecorder) take() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	keys := k.keys
	k.keys = nil
	return keys
}

// TestClientKeepsKeyAcrossRetries: the client interceptor gives a call
// one key, which every attempt of gRPC's retry policy sends; the server
// runs the call once it succeeds and replays it after. A new call gets a
// new key; WithKey and a key already in the metadata are kept.
func TestClientKeepsKeyAcrossRetries(t *testing.T) {
	svc := &service{}
	var fail sync.Map // sku → attempts still to fail
	svc.handle = func(_ context.Context, req *structpb.Struct) (*structpb.Struct, error) {
		sku := req.Fields["sku"].GetStringValue()
		if v, ok := fail.Load(sku); ok && v.(int) > 0 {
			fail.Store(sku, v.(int)-1)
			return nil, status.Error(codes.Unavailable, "try again")
		}
		return mustStruct(t, map[string]any{"sku": sku}), nil
	}
	rec := new(keyRecorder)
	conn := serve(t, svc,
		[]grpc.UnaryServerInterceptor{rec.intercept, idemgrpc.UnaryServerInterceptor(memstore.New(memstore.Options{}), testOptions())},
		grpc.WithDefaultServiceConfig(retryConfig),
		grpc.WithUnaryInterceptor(idemgrpc.UnaryClientInterceptor(idemgrpc.ClientOptions{})),
	)
	ctx := t.Context()

	// One call whose first attempt fails: gRPC retries it with its key.
	fail.Store("SKU-1", 1)
	if err := conn.Invoke(ctx, createMethod, order(t, "SKU-1"), new(structpb.Struct)); err != nil {
		t.Fatalf("call with one failed attempt: %v", err)
	}
	keys := rec.take()
	if len(keys) != 2 || keys[0] == "" || keys[0] != keys[1] {
		t.Fatalf("keys of the attempts: %q, want two, the same", keys)
	}
	if got := svc.runs.Load(); got != 2 {
		t.Errorf("handler ran %d times, want 2", got)
	}
	first := keys[0]

	// A new call is a new operation: a new key, so it runs.
	if err := conn.Invoke(ctx, createMethod, order(t, "SKU-1"), new(structpb.Struct)); err != nil {
		t.Fatal(err)
	}
	if keys := rec.take(); len(keys) != 1 || keys[0] == "" || keys[0] == first {
		t.Errorf("second call's keys %q, want one new key", keys)
	}
	if got := svc.runs.Load(); got != 3 {
		t.Errorf("handler ran %d times, want 3", got)
	}

	// The caller's own retry with WithKey: the first call's key again,
	// so the server replays it.
	var hdr metadata.MD
	if err := conn.Invoke(idemgrpc.WithKey(ctx, first), createMethod, order(t, "SKU-1"), new(structpb.Struct), grpc.Header(&hdr)); err != nil {
		t.Fatal(err)
	}
	if keys := rec.take(); len(keys) != 1 || keys[0] != first {
		t.Errorf("WithKey's call sent %q, want %q", keys, first)
	}
	if v := hdr.Get(idemgrpc.ReplayedMetadata); len(v) != 1 || v[0] != "true" {
		t.Errorf("WithKey's retry was not replayed: header %v", hdr)
	}
	if got := svc.runs.Load(); got != 3 {
		t.Errorf("handler ran %d times, want 3", got)
	}

	// A key the caller put in the metadata itself is kept, not doubled.
	own := metadata.AppendToOutgoingContext(ctx, idemgrpc.KeyMetadata, "own-key")
	if err := conn.Invoke(own, createMethod, order(t, "SKU-2"), new(structpb.Struct)); err != nil {
		t.Fatal(err)
	}
	if keys := rec.take(); len(keys) != 1 || keys[0] != "own-key" {
		t.Errorf("metadata key: sent %q, want [own-key]", keys)
	}
}

// TestClientMethods: ClientOptions.Methods picks the calls that carry a
// key.
func TestClientMethods(t *testing.T) {
	svc := &service{handle: func(context.Context, *structpb.Struct) (*structpb.Struct, error) { return new(structpb.Struct), nil }}
	rec := new(keyRecorder)
	conn := serve(t, svc, []grpc.UnaryServerInterceptor{rec.intercept},
		grpc.WithUnaryInterceptor(idemgrpc.UnaryClientInterceptor(idemgrpc.ClientOptions{
			Methods: func(m string) bool { return m == createMethod },
			NewKey:  func() string { return "fixed" },
		})))
	if err := conn.Invoke(t.Context(), peekMethod, order(t, "SKU-1"), new(structpb.Struct)); err != nil {
		t.Fatal(err)
	}
	if err := conn.Invoke(t.Context(), createMethod, order(t, "SKU-1"), new(structpb.Struct)); err != nil {
		t.Fatal(err)
	}
	if keys := rec.take(); len(keys) != 2 || keys[0] != "" || keys[1] != "fixed" {
		t.Errorf("keys %q, want [\"\" fixed]", keys)
	}
}
