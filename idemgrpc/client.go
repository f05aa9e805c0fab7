package idemgrpc

import (
	"context"

	"github.com/idem-go/idem/client"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// ClientOptions configures UnaryClientInterceptor. The zero value is
// usable.
type ClientOptions struct {
	// Methods, if set, picks the methods (by full method name) whose
	// calls carry a key. Default nil: every unary call (a server ignores
	// the key of a method it does not opt in).
	Methods func(fullMethod string) bool
	// NewKey makes the key of a call that has none. Default NewKey (a
	// random UUIDv4).
	NewKey func() string
}

// UnaryClientInterceptor returns an interceptor that gives every call one
// idempotency key, in its outgoing metadata (KeyMetadata): the key the
// caller put there itself, else the one WithKey put in the call's
// context, else a new one (ClientOptions.NewKey).
//
// The interceptor runs once per call, above gRPC's own retries (a
// service config's retryPolicy, transparent retries): every attempt of
// the call sends the same key, so the server runs the call once. A new
// call is a new operation and gets a new key; to send one operation
// again yourself (after the call failed, or from another process), give
// each call of it the same key with WithKey.
func UnaryClientInterceptor(opts ClientOptions) grpc.UnaryClientInterceptor {
	newKey := opts.NewKey
	if newKey == nil {
		newKey = NewKey
	}
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
		if opts.Methods == nil || opts.Methods(method) {
			ctx = withOutgoingKey(ctx, newKey)
		}
		return invoker(ctx, method, req, reply, cc, callOpts...)
	}
}

// withOutgoingKey returns ctx with a key in its outgoing metadata: the
// one already there, WithKey's, or newKey's.
func withOutgoingKey(ctx context.Context, newKey func() string) context.Context {
	if md, ok := metadata.FromOutgoingContext(ctx); ok && len(md.Get(KeyMetadata)) > 0 {
		return ctx
	}
	key, ok := KeyFromContext(ctx)
	if !ok {
		key = newKey()
	}
	return metadata.AppendToOutgoingContext(ctx, KeyMetadata, key)
}

// WithKey returns a context whose calls through UnaryClientInterceptor
// carry key: give every call of one operation (the first and the
// caller's own retries of it) the same key, and each new operation a new
// one (NewKey). It is client.WithKey: one context serves HTTP requests
// through client.Transport and gRPC calls alike.
func WithKey(ctx context.Context, key string) context.Context {
	return client.WithKey(ctx, key)
}

// KeyFromContext returns the key WithKey put in ctx.
func KeyFromContext(ctx context.Context) (string, bool) {
	return client.KeyFromContext(ctx)
}

// NewKey returns a new random key (a UUIDv4), as client.NewKey.
func NewKey() string { return client.NewKey() }
