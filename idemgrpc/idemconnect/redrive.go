package idemconnect

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"connectrpc.com/connect"
	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemgrpc/internal/rpcidem"
	"google.golang.org/protobuf/proto"
)

// CompleterFunc returns the function with which an idem.Completer
// finishes the abandoned calls of procedure, a unary procedure that
// opts.Methods opts in, for idem.CompleterOptions.Funcs[procedure]: a
// call whose server died (or whose handler failed with a retryable code)
// after it claimed its key is run again once its lease ran out, without
// the client retrying. handler is the procedure's handler, the function
// given to connect.NewUnaryHandler; opts are the interceptor's (Methods,
// Stored and Logger are read).
//
// The function decodes the stored input, the request's deterministic
// encoding, into a new Req and calls handler with it, without the
// handler's interceptors: give as handler one that also makes the
// checks of the interceptors that run inside idemconnect's (an
// authorization check, a quota), for a call that one of them refused
// with a code that leaves the key retryable (PermissionDenied,
// ResourceExhausted) is re-driven too, and the handler alone would run
// it unchecked. Its answer is stored exactly as the
// interceptor stores a call's, and by the same rule (opts.Stored): the
// client's retry with the key then replays it through the interceptor,
// or through idemgrpc's on the same store. A code that opts.Stored
// leaves retryable, or a panic, is the function's error: the handler's
// writes roll back, and the key stays retryable, for the client's retry
// or the completer's next re-drive.
//
// The re-drive's request is connect.NewRequest's: no header, no peer, a
// zero Spec. The handler must not depend on them. Its context is
// idem.Do's, as in a call: it writes through the attempt's transaction
// (idem.TxFromContext, pgstore.FromContext, …), and learns its user, the
// one Options.User named when the call claimed the key, from
// idem.LeaseFromContext(ctx) (the lease's User), which holds in a call
// and in a re-drive alike. The completer's
// idem.CompleterOptions.Middleware gives the re-drive's Lease and TTL:
// set them as opts'.
//
// It panics with a message naming the misuse: a nil handler, a
// procedure not in opts.Methods (its calls are not run through idem.Do:
// there is nothing to finish), a *Req or *Res that is not a
// proto.Message, or a Res other than the response type of
// opts.Methods[procedure].
func CompleterFunc[Req, Res any](procedure string, handler func(context.Context, *connect.Request[Req]) (*connect.Response[Res], error), opts Options) idem.DoFunc {
	const name = "idemconnect.CompleterFunc"
	if handler == nil {
		panic(fmt.Sprintf("%s: nil handler of %q", name, procedure))
	}
	m, ok := opts.Methods[procedure]
	if !ok || m.newMsg == nil {
		panic(fmt.Sprintf("%s: %q is not in Options.Methods (or its Method is the zero value): its calls are not made idempotent, so none is left to finish", name, procedure))
	}
	if _, ok := any(new(Req)).(proto.Message); !ok {
		panic(fmt.Sprintf("%s: the request of %q, a %T, is not a proto.Message", name, procedure, new(Req)))
	}
	res, ok := any(new(Res)).(proto.Message)
	if !ok {
		panic(fmt.Sprintf("%s: the response of %q, a %T, is not a proto.Message", name, procedure, new(Res)))
	}
	if got, want := res.ProtoReflect().Descriptor().FullName(), m.newMsg().ProtoReflect().Descriptor().FullName(); got != want {
		panic(fmt.Sprintf("%s: the handler of %q answers a %s, Options.Methods builds a %s", name, procedure, got, want))
	}
	stored := rpcidem.StoredCode
	if opts.Stored != nil {
		stored = func(c uint32) bool { return opts.Stored(connect.Code(c)) }
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	core := &rpcidem.Server{Protocol: protocol, Stored: stored, Logger: opts.Logger}
	return core.Redrive(procedure, m.newMsg, func(ctx context.Context, input []byte) (any, error) {
		req := new(Req)
		if err := proto.Unmarshal(input, any(req).(proto.Message)); err != nil {
			return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("idemconnect: the stored request of %s does not decode into a %T: %w", procedure, req, err))
		}
		resp, err := handler(ctx, connect.NewRequest(req))
		if err != nil {
			return nil, err
		}
		if resp == nil {
			return nil, connect.NewError(connect.CodeInternal, errors.New("idemconnect: the handler of "+procedure+" answered a nil response without an error"))
		}
		return resp.Msg, nil
	})
}
