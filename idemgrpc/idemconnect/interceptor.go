package idemconnect

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"time"

	"connectrpc.com/connect"
	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemgrpc/internal/rpcidem"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

// The names on the wire, idemgrpc's, so that one call means the same
// through either interceptor (see the package documentation): the key's
// request header (HTTP header names are case-insensitive: this is
// Idempotency-Key), the replay's response header, the in-flight
// answer's retry-after, and the domain and reasons of the ErrorInfo
// detail of the interceptor's own CodeInvalidArgument answers (the key
// reused with another request, missing, or invalid: not 1 to 255
// characters of visible ASCII or an RFC 8941 sf-string of them, or more
// than one).
const (
	KeyHeader        = rpcidem.KeyMetadata
	ReplayedHeader   = rpcidem.ReplayedMetadata
	RetryAfterHeader = rpcidem.RetryAfterMetadata
	ErrorDomain      = rpcidem.ErrorDomain
	ReasonKeyReused  = rpcidem.ReasonKeyReused
	ReasonKeyMissing = rpcidem.ReasonKeyMissing
	ReasonKeyInvalid = rpcidem.ReasonKeyInvalid
)

// Method is an opted-in procedure's response type: Response builds it.
type Method struct {
	newMsg  func() proto.Message
	respond func(proto.Message) connect.AnyResponse
}

// Response is the Method of a procedure answering a *T (generated code's
// response message, or a well-known type): Response[shoppb.Order](). A
// replay does not run the handler, so this is how the interceptor builds
// the *connect.Response[T] it answers with.
func Response[T any, PT interface {
	*T
	proto.Message
}]() Method {
	return Method{
		newMsg:  func() proto.Message { return PT(new(T)) },
		respond: func(m proto.Message) connect.AnyResponse { return connect.NewResponse((*T)(m.(PT))) },
	}
}

// Options configures NewInterceptor: idemgrpc.Options for Connect.
// Methods and User are required; every other field documents its
// default, which a zero value stands for.
type Options struct {
	// Methods opts procedures in: a procedure ("/pkg.Service/Method", as
	// connect.Spec.Procedure and generated code's …Procedure constants
	// spell it, the same as gRPC's full method name) maps to its
	// response type (Response). Calls of any other procedure pass
	// through untouched. Required: at least one.
	Methods map[string]Method
	// User returns the scope of a key from the call's context and
	// request (its Header and Peer): the same key from two users names
	// two operations. Return the authenticated caller (never a value the
	// client chooses unchecked). An error is the call's answer (as it is
	// if it is a *connect.Error, else CodeUnauthenticated); an empty user
	// is CodeUnauthenticated. Required, as idemgrpc.Options.User is.
	User func(ctx context.Context, req connect.AnyRequest) (string, error)
	// OptionalKey lets calls of opted-in procedures without a key
	// through, unprotected. Default false: such a call is answered
	// CodeInvalidArgument (ReasonKeyMissing).
	OptionalKey bool
	// Stored, Lease, TTL, InFlightWait, Logger and Metrics are
	// idemgrpc.Options' fields of the same names, with the same defaults:
	// Stored decides which error codes are stored (a success always is;
	// default StoredCode), the durations are idem.DoParams' (default
	// idem.DefaultLease, idem.DefaultTTL, and no wait: CodeAborted at
	// once), Logger defaults to slog.Default(), Metrics counts outcomes
	// if set.
	Stored                   func(connect.Code) bool
	Lease, TTL, InFlightWait time.Duration
	Logger                   *slog.Logger
	Metrics                  *idem.Metrics
}

// StoredCode is the default Options.Stored, idemgrpc.StoredCode's table:
// CodeInvalidArgument, CodeNotFound, CodeAlreadyExists,
// CodeFailedPrecondition, CodeOutOfRange and CodeUnimplemented are
// stored; every other code leaves the key retryable.
func StoredCode(c connect.Code) bool { return rpcidem.StoredCode(uint32(c)) }

// anyPrefix is the type URL prefix of error details (connect's
// ErrorDetail.Type drops it).
const anyPrefix = "type.googleapis.com/"

// protocol is Connect's side of the shared interceptor: its errors are
// *connect.Error.
var protocol = rpcidem.Protocol{
	Name:       "idemconnect",
	KeyCarrier: "header",
	Status: func(err error) (*spb.Status, bool) {
		var ce *connect.Error
		if !errors.As(err, &ce) {
			return nil, false
		}
		st := &spb.Status{Code: int32(ce.Code()), Message: ce.Message()}
		for _, d := range ce.Details() {
			st.Details = append(st.Details, &anypb.Any{TypeUrl: anyPrefix + d.Type(), Value: d.Bytes()})
		}
		return st, true
	},
	Error: func(st *spb.Status) error {
		ce := connect.NewError(connect.Code(st.GetCode()), errors.New(st.GetMessage()))
		for _, a := range st.GetDetails() {
			if d, err := connect.NewErrorDetail(a); err == nil {
				ce.AddDetail(d)
			}
		}
		return ce
	},
}

// interceptor is one NewInterceptor.
type interceptor struct {
	core    rpcidem.Server
	methods map[string]Method
	user    func(ctx context.Context, req connect.AnyRequest) (string, error)
}

// NewInterceptor returns a handler interceptor (connect.WithInterceptors)
// that makes the unary procedures in opts.Methods idempotent with store,
// on top of idem.Do (see the package documentation for what it answers).
// Streaming procedures, and a client's calls, pass through untouched.
//
// It checks its arguments when called and panics with a message naming
// what is wrong: a nil store, a nil Options.User, no Options.Methods, a
// procedure that is not "/service/method" (at most 255 bytes, without
// control characters) or whose Method is the zero value, a negative
// duration, or a Lease (or its default) not shorter than the TTL (or its
// default).
func NewInterceptor(store idem.Store, opts Options) connect.Interceptor {
	// A copy: a caller changing its map later changes nothing here.
	methods := make(map[string]Method, len(opts.Methods))
	set := make(map[string]bool, len(opts.Methods))
	for p, m := range opts.Methods {
		methods[p], set[p] = m, m.newMsg != nil
	}
	rpcidem.Check("idemconnect.NewInterceptor", store, opts.User != nil, set, opts.Lease, opts.TTL, opts.InFlightWait)
	stored := rpcidem.StoredCode
	if opts.Stored != nil {
		stored = func(c uint32) bool { return opts.Stored(connect.Code(c)) }
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &interceptor{
		core: rpcidem.Server{
			Store:        store,
			Protocol:     protocol,
			OptionalKey:  opts.OptionalKey,
			Stored:       stored,
			Lease:        opts.Lease,
			TTL:          opts.TTL,
			InFlightWait: opts.InFlightWait,
			Logger:       opts.Logger,
			Metrics:      opts.Metrics,
		},
		methods: methods,
		user:    opts.User,
	}
}

// WrapUnary makes the call idempotent if its procedure is opted in.
func (i *interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		m, ok := i.methods[req.Spec().Procedure]
		if !ok {
			return next(ctx, req)
		}
		a := i.core.Serve(ctx, rpcidem.Call{
			Method:  req.Spec().Procedure,
			Keys:    req.Header().Values(KeyHeader),
			Req:     req.Any(),
			NewResp: m.newMsg,
			User:    func() (string, error) { return i.user(ctx, req) },
			Run: func(ctx context.Context) (any, any, error) {
				resp, err := next(ctx, req)
				if err != nil {
					return resp, nil, err
				}
				return resp, resp.Any(), nil
			},
		})
		if a.Err != nil {
			var ce *connect.Error
			if (a.Replayed || a.RetryAfter > 0) && errors.As(a.Err, &ce) {
				if a.Replayed {
					// In the response header, as idemgrpc's replays: the
					// gRPC protocol sends an error's metadata as
					// trailers (only the Connect protocol as headers).
					if info, ok := connect.CallInfoForHandlerContext(ctx); ok {
						info.ResponseHeader().Set(ReplayedHeader, "true")
					} else {
						ce.Meta().Set(ReplayedHeader, "true")
					}
				}
				if a.RetryAfter > 0 {
					ce.Meta().Set(RetryAfterHeader, strconv.Itoa(a.RetryAfter))
				}
			}
			return nil, a.Err
		}
		if a.Replayed {
			resp := m.respond(a.Resp.(proto.Message))
			resp.Header().Set(ReplayedHeader, "true")
			return resp, nil
		}
		resp, _ := a.Resp.(connect.AnyResponse)
		return resp, nil
	}
}

// WrapStreamingClient passes streams through untouched.
func (i *interceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

// WrapStreamingHandler passes streams through untouched.
func (i *interceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}
