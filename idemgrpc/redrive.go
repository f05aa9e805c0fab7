package idemgrpc

import (
	"context"
	"fmt"
	"log/slog"
	"reflect"
	"slices"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemgrpc/internal/rpcidem"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// CompleterFuncs returns the functions with which an idem.Completer
// finishes the abandoned calls of desc's unary methods that opts.Methods
// opts in, by full method name, for idem.CompleterOptions.Funcs: a call
// whose server died (or whose handler failed with a retryable code)
// after it claimed its key is run again once its lease ran out, without
// the client retrying. Give it the interceptor's opts (Methods, Stored
// and Logger are read) and the implementation registered with desc.
//
// Each function decodes the stored input, the request's deterministic
// encoding, into the method's request message and calls the method's
// generated handler, MethodDesc.Handler, with impl and inner, chained
// as grpc.ChainUnaryInterceptor chains them: the implementation's
// method, without a server and without the server's other interceptors.
// Its answer is stored exactly as the interceptor stores a call's, and
// by the same rule (opts.Stored): the client's retry with the key then
// replays it through the interceptor, or through idemconnect's on the
// same store. A code that opts.Stored leaves retryable, or a panic, is
// the function's error: the handler's writes roll back, and the key
// stays retryable, for the client's retry or the completer's next
// re-drive.
//
// Give as inner the server's interceptors that run after (inside)
// idemgrpc's, in the server's order: a call that one of them refused
// with a code that leaves the key retryable (an authorization check's
// PermissionDenied, a quota's ResourceExhausted) is re-driven too, and
// is then refused again, never run without the check; left out, such a
// call is run by the re-drive as if it had passed. They see a re-drive
// as the handler does (below): one that needs the call's metadata
// refuses every re-drive, which leaves the key to the client's retry
// only with a code that opts.Stored leaves retryable (StoredCode leaves
// PermissionDenied, Unauthenticated and ResourceExhausted so); a
// refusal with a stored code is stored.
//
// A re-drive has no incoming metadata, no peer and no stream
// (grpc.SetHeader fails): the handler must not depend on them. Its
// context is idem.Do's, as in a call: it writes through the attempt's
// transaction (idem.TxFromContext, pgstore.FromContext, …), and learns
// its user, the one Options.User named when the call claimed the key,
// from idem.LeaseFromContext(ctx) (the lease's User), which holds in a
// call and in a re-drive alike. The completer's
// idem.CompleterOptions.Middleware gives the re-drive's Lease and TTL:
// set them as opts' (a lease longer than the handler may run).
//
// Methods of opts.Methods that desc lacks (another service's) are not in
// the map, nor are desc's methods that opts.Methods does not opt in: the
// completer skips their records without claiming them. For several
// services, merge their maps (maps.Copy).
//
// It panics with a message naming the misuse: a nil desc, impl or inner
// interceptor, an impl that does not implement desc.HandlerType (as
// grpc.RegisterService checks it), a method opted in with a nil function
// or without a Handler, or none of desc's methods in opts.Methods.
func CompleterFuncs(desc *grpc.ServiceDesc, impl any, opts Options, inner ...grpc.UnaryServerInterceptor) map[string]idem.DoFunc {
	const name = "idemgrpc.CompleterFuncs"
	if desc == nil {
		panic(name + ": nil ServiceDesc")
	}
	if impl == nil {
		panic(name + ": nil implementation of " + desc.ServiceName)
	}
	if v := reflect.ValueOf(impl); v.Kind() == reflect.Pointer && v.IsNil() {
		panic(fmt.Sprintf("%s: the implementation of %s is a nil %T", name, desc.ServiceName, impl))
	}
	if desc.HandlerType != nil {
		if ht := reflect.TypeOf(desc.HandlerType).Elem(); !reflect.TypeOf(impl).Implements(ht) {
			panic(fmt.Sprintf("%s: %T does not implement %v, %s's handler type", name, impl, ht, desc.ServiceName))
		}
	}
	for i, in := range inner {
		if in == nil {
			panic(fmt.Sprintf("%s: inner interceptor %d is nil", name, i))
		}
	}
	chain := chainInner(inner)
	core := redriveServer(opts)
	funcs := make(map[string]idem.DoFunc)
	for _, md := range desc.Methods {
		method := "/" + desc.ServiceName + "/" + md.MethodName
		newResp, ok := opts.Methods[method]
		if !ok {
			continue
		}
		if newResp == nil {
			panic(fmt.Sprintf("%s: Options.Methods[%q] is nil", name, method))
		}
		if md.Handler == nil {
			panic(fmt.Sprintf("%s: %s has no Handler", name, method))
		}
		handler := md.Handler
		funcs[method] = core.Redrive(method, newResp, func(ctx context.Context, input []byte) (any, error) {
			dec := func(req any) error {
				m, ok := req.(proto.Message)
				if !ok {
					return status.Errorf(codes.Internal, "idemgrpc: request of %s is a %T, not a proto.Message", method, req)
				}
				if err := proto.Unmarshal(input, m); err != nil {
					return status.Errorf(codes.Internal, "idemgrpc: the stored request of %s does not decode into a %T: %v", method, req, err)
				}
				return nil
			}
			return handler(impl, ctx, dec, chain)
		})
	}
	if len(funcs) == 0 {
		panic(fmt.Sprintf("%s: none of %s's %d unary methods is in Options.Methods: nothing to re-drive", name, desc.ServiceName, len(desc.Methods)))
	}
	return funcs
}

// chainInner is the interceptor a re-drive gives a method's Handler:
// inner in order, the first outermost, then the implementation; with
// none, one that only calls on (generated code calls the implementation
// directly without an interceptor, nil, but a hand-written Handler may
// call it unchecked).
func chainInner(inner []grpc.UnaryServerInterceptor) grpc.UnaryServerInterceptor {
	inner = slices.Clone(inner)
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		var next func(i int) grpc.UnaryHandler
		next = func(i int) grpc.UnaryHandler {
			if i == len(inner) {
				return handler
			}
			return func(ctx context.Context, req any) (any, error) {
				return inner[i](ctx, req, info, next(i+1))
			}
		}
		return next(0)(ctx, req)
	}
}

// redriveServer is the shared core with opts' Stored and Logger, as
// UnaryServerInterceptor builds it, for a re-drive's answer.
func redriveServer(opts Options) *rpcidem.Server {
	stored := rpcidem.StoredCode
	if opts.Stored != nil {
		stored = func(c uint32) bool { return opts.Stored(codes.Code(c)) }
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &rpcidem.Server{Protocol: protocol, Stored: stored, Logger: opts.Logger}
}
