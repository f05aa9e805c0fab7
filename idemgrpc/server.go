package idemgrpc

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemgrpc/internal/rpcidem"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// Metadata keys the interceptors read and write (gRPC metadata keys are
// lower case).
const (
	// KeyMetadata carries the idempotency key of a call, as the HTTP
	// Idempotency-Key header does, with the same syntax (idem.ParseKey).
	KeyMetadata = rpcidem.KeyMetadata
	// ReplayedMetadata is set to "true" in the response header metadata
	// of an answer replayed from the store.
	ReplayedMetadata = rpcidem.ReplayedMetadata
	// RetryAfterMetadata is set, in the trailer metadata, to the seconds
	// to wait before sending a call again that was answered Aborted
	// because another call with its key is in flight.
	RetryAfterMetadata = rpcidem.RetryAfterMetadata
)

// ErrorInfo reasons of the interceptor's own InvalidArgument answers, in
// a google.rpc.ErrorInfo detail of domain ErrorDomain.
const (
	ErrorDomain = rpcidem.ErrorDomain
	// ReasonKeyReused: the key was first used with another method or
	// request message.
	ReasonKeyReused = rpcidem.ReasonKeyReused
	// ReasonKeyMissing: an opted-in method was called without a key and
	// Options.OptionalKey is false.
	ReasonKeyMissing = rpcidem.ReasonKeyMissing
	// ReasonKeyInvalid: the key is not 1 to 255 characters of visible
	// ASCII (or a valid RFC 8941 sf-string of them), or the call carried
	// more than one.
	ReasonKeyInvalid = rpcidem.ReasonKeyInvalid
)

// Options configures UnaryServerInterceptor. Methods and User are
// required; every other field documents its default, which a zero value
// stands for.
type Options struct {
	// Methods opts methods in: a full method name ("/pkg.Service/Method",
	// as grpc.UnaryServerInfo.FullMethod spells it) maps to a function
	// that returns a new, empty message of the method's response type. A
	// replay does not run the handler, so this is how the interceptor
	// builds the message it unmarshals the stored answer into. Calls of
	// any other method pass through untouched. Required: at least one.
	Methods map[string]func() proto.Message
	// User returns the scope of a key from the call's context: the same
	// key from two users names two operations. Return the authenticated
	// caller (never a value the client chooses unchecked). An error is
	// the call's answer (as it is if it holds a gRPC status, else
	// Unauthenticated); an empty user is Unauthenticated. Required: there
	// is no default, as with idem.Options.User, because a key space shared
	// by every caller lets anyone who sends another caller's key and
	// request replay that caller's answer; to share one on purpose,
	// return a constant.
	User func(ctx context.Context) (string, error)
	// OptionalKey lets calls of opted-in methods without a key through,
	// unprotected. Default false: such a call is answered InvalidArgument
	// (ReasonKeyMissing), as the HTTP middleware answers 400.
	OptionalKey bool
	// Stored decides which error codes are final outcomes, stored and
	// replayed (their handler's writes commit); the others leave the key
	// retryable (their writes roll back). OK is always stored, whatever
	// it says. Default StoredCode.
	Stored func(codes.Code) bool
	// Lease, TTL and InFlightWait are idem.DoParams': how long one call
	// holds the key (longer than any call may run; default
	// idem.DefaultLease, 30s), how long the key lives (default
	// idem.DefaultTTL, 24h), how long a repeat waits for a call in flight
	// to finish and replays it (default 0: Aborted at once).
	Lease, TTL, InFlightWait time.Duration
	// Logger receives idem.Do's logs and the interceptor's. Default
	// slog.Default().
	Logger *slog.Logger
	// Metrics, if set, counts outcomes (idem.DoParams.Metrics).
	Metrics *idem.Metrics
}

// StoredCode is the default Options.Stored: OK and the codes that are a
// final answer to the request itself (InvalidArgument, NotFound,
// AlreadyExists, FailedPrecondition, OutOfRange, Unimplemented). Every
// other code (Canceled, Unknown, DeadlineExceeded, PermissionDenied,
// ResourceExhausted, Aborted, Internal, Unavailable, DataLoss,
// Unauthenticated) is transient or depends on something the request
// does not carry (the caller's credentials, quotas, a deadline), so it
// leaves the key retryable. See the package documentation's table.
func StoredCode(c codes.Code) bool { return rpcidem.StoredCode(uint32(c)) }

// protocol is gRPC's side of the shared interceptor: its errors are
// status errors.
var protocol = rpcidem.Protocol{
	Name:       "idemgrpc",
	KeyCarrier: "metadata entry",
	Status: func(err error) (*spb.Status, bool) {
		st, ok := status.FromError(err)
		if !ok {
			return nil, false
		}
		return st.Proto(), true
	},
	Error: func(st *spb.Status) error { return status.FromProto(st).Err() },
}

// server is one UnaryServerInterceptor.
type server struct {
	core    rpcidem.Server
	methods map[string]func() proto.Message
	user    func(ctx context.Context) (string, error)
}

// UnaryServerInterceptor returns an interceptor that makes the unary
// methods in opts.Methods idempotent with store, on top of idem.Do (see
// the package documentation for what it answers).
//
// It checks its arguments when called and panics with a message naming
// what is wrong: a nil store, a nil Options.User, no Options.Methods, a
// method name that is not "/service/method" (at most 255 bytes, without
// control characters) or whose function is nil or returns a nil message,
// a negative duration, or a Lease (or its default) not shorter than the
// TTL (or its default).
func UnaryServerInterceptor(store idem.Store, opts Options) grpc.UnaryServerInterceptor {
	// A copy: a caller changing its map later changes nothing here.
	methods := make(map[string]func() proto.Message, len(opts.Methods))
	set := make(map[string]bool, len(opts.Methods))
	for m, f := range opts.Methods {
		methods[m], set[m] = f, f != nil
	}
	rpcidem.Check("idemgrpc.UnaryServerInterceptor", store, opts.User != nil, set, opts.Lease, opts.TTL, opts.InFlightWait)
	for m, f := range methods {
		// A replay unmarshals into what f returns: a nil message would
		// panic there, on the first replay, outside any recovery.
		if msg := f(); msg == nil || !msg.ProtoReflect().IsValid() {
			panic(fmt.Sprintf("idemgrpc.UnaryServerInterceptor: Options.Methods[%q] returns a nil message; return a new one (new(pb.Reply))", m))
		}
	}
	stored := rpcidem.StoredCode
	if opts.Stored != nil {
		stored = func(c uint32) bool { return opts.Stored(codes.Code(c)) }
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	s := &server{
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
	return s.intercept
}

func (s *server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	newResp, ok := s.methods[info.FullMethod]
	if !ok {
		return handler(ctx, req)
	}
	a := s.core.Serve(ctx, rpcidem.Call{
		Method:  info.FullMethod,
		Keys:    metadata.ValueFromIncomingContext(ctx, KeyMetadata), // no copy of the whole metadata
		Req:     req,
		NewResp: newResp,
		User:    func() (string, error) { return s.user(ctx) },
		Run: func(ctx context.Context) (any, any, error) {
			resp, err := handler(ctx, req)
			return resp, resp, err
		},
	})
	if a.Replayed {
		_ = grpc.SetHeader(ctx, metadata.Pairs(ReplayedMetadata, "true"))
	}
	if a.RetryAfter > 0 {
		// In the trailer: a header would make the answer other than
		// Trailers-Only, which gRPC's retry policy never retries.
		_ = grpc.SetTrailer(ctx, metadata.Pairs(RetryAfterMetadata, strconv.Itoa(a.RetryAfter)))
	}
	if a.Err != nil {
		return nil, a.Err
	}
	return a.Resp, nil
}
