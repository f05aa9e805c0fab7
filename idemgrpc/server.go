package idemgrpc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/idem-go/idem"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
)

// Metadata keys the interceptors read and write (gRPC metadata keys are
// lower case).
const (
	// KeyMetadata carries the idempotency key of a call, as the HTTP
	// Idempotency-Key header does, with the same syntax (idem.ParseKey).
	KeyMetadata = "idempotency-key"
	// ReplayedMetadata is set to "true" in the response header metadata
	// of an answer replayed from the store.
	ReplayedMetadata = "idempotent-replayed"
	// RetryAfterMetadata is set, in the trailer metadata, to the seconds
	// to wait before sending a call again that was answered Aborted
	// because another call with its key is in flight.
	RetryAfterMetadata = "retry-after"
)

// ErrorInfo reasons of the interceptor's own InvalidArgument answers, in
// a google.rpc.ErrorInfo detail of domain ErrorDomain.
const (
	ErrorDomain = "idem-go.github.io"
	// ReasonKeyReused: the key was first used with another method or
	// request message.
	ReasonKeyReused = "IDEMPOTENCY_KEY_REUSED"
	// ReasonKeyMissing: an opted-in method was called without a key and
	// Options.OptionalKey is false.
	ReasonKeyMissing = "IDEMPOTENCY_KEY_MISSING"
	// ReasonKeyInvalid: the key is not 1 to 255 characters of visible
	// ASCII (or a valid RFC 8941 sf-string of them), or the call carried
	// more than one.
	ReasonKeyInvalid = "IDEMPOTENCY_KEY_INVALID"
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
func StoredCode(c codes.Code) bool {
	switch c {
	case codes.OK, codes.InvalidArgument, codes.NotFound, codes.AlreadyExists,
		codes.FailedPrecondition, codes.OutOfRange, codes.Unimplemented:
		return true
	}
	return false
}

// server is one UnaryServerInterceptor.
type server struct {
	store idem.Store
	opts  Options
}

// UnaryServerInterceptor returns an interceptor that makes the unary
// methods in opts.Methods idempotent with store, on top of idem.Do (see
// the package documentation for what it answers).
//
// It checks its arguments when called and panics with a message naming
// what is wrong: a nil store, a nil Options.User, no Options.Methods, a
// method name that is not "/service/method" (at most 255 bytes, without
// control characters) or whose function is nil, a negative duration, or
// a Lease (or its default) not shorter than the TTL (or its default).
func UnaryServerInterceptor(store idem.Store, opts Options) grpc.UnaryServerInterceptor {
	if store == nil {
		panic("idemgrpc.UnaryServerInterceptor: nil Store")
	}
	if opts.User == nil {
		panic("idemgrpc.UnaryServerInterceptor: Options.User is nil: give the function that names the caller " +
			"(a key belongs to one user: without it, anyone who sends another caller's key and request gets that caller's stored answer)")
	}
	if len(opts.Methods) == 0 {
		panic("idemgrpc.UnaryServerInterceptor: no Options.Methods: name the methods to make idempotent")
	}
	for m, f := range opts.Methods {
		if !validMethod(m) {
			panic(fmt.Sprintf("idemgrpc.UnaryServerInterceptor: Options.Methods key %q is not a full method name (/service/method, at most %d bytes, no control characters)", m, idem.MaxKeyLength))
		}
		if f == nil {
			panic(fmt.Sprintf("idemgrpc.UnaryServerInterceptor: Options.Methods[%q] is nil", m))
		}
	}
	if opts.Lease < 0 || opts.TTL < 0 || opts.InFlightWait < 0 {
		panic("idemgrpc.UnaryServerInterceptor: negative Lease, TTL or InFlightWait (zero means the default)")
	}
	lease, ttl := opts.Lease, opts.TTL
	if lease == 0 {
		lease = idem.DefaultLease
	}
	if ttl == 0 {
		ttl = idem.DefaultTTL
	}
	if lease >= ttl {
		panic(fmt.Sprintf("idemgrpc.UnaryServerInterceptor: Lease %v not shorter than TTL %v", lease, ttl))
	}
	if opts.Stored == nil {
		opts.Stored = StoredCode
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	// A copy: a caller changing its map later changes nothing here.
	methods := make(map[string]func() proto.Message, len(opts.Methods))
	for m, f := range opts.Methods {
		methods[m] = f
	}
	opts.Methods = methods
	s := &server{store: store, opts: opts}
	return s.intercept
}

// validMethod reports whether m is a full method name that idem.Do takes
// as an operation's name.
func validMethod(m string) bool {
	if len(m) < 4 || len(m) > idem.MaxKeyLength || m[0] != '/' {
		return false
	}
	if i := strings.LastIndexByte(m, '/'); i <= 1 || i == len(m)-1 {
		return false
	}
	for _, r := range m {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) || r == 0xfffd {
			return false
		}
	}
	return true
}

func (s *server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	newResp, ok := s.opts.Methods[info.FullMethod]
	if !ok {
		return handler(ctx, req)
	}
	key, present, err := keyOf(ctx)
	if err != nil {
		s.count(func(m *idem.Metrics) { m.Invalid.Add(1) })
		return nil, withInfo(codes.InvalidArgument, err.Error(), ReasonKeyInvalid, info.FullMethod)
	}
	if !present {
		if s.opts.OptionalKey {
			s.count(func(m *idem.Metrics) { m.Unprotected.Add(1) })
			return handler(ctx, req)
		}
		s.count(func(m *idem.Metrics) { m.Invalid.Add(1) })
		return nil, withInfo(codes.InvalidArgument, "idemgrpc: this method needs an "+KeyMetadata+" metadata entry", ReasonKeyMissing, info.FullMethod)
	}
	msg, ok := req.(proto.Message)
	if !ok {
		return nil, status.Errorf(codes.Internal, "idemgrpc: request of %s is a %T, not a proto.Message", info.FullMethod, req)
	}
	input, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "idemgrpc: encoding the request: %v", err)
	}
	user, err := s.opts.User(ctx)
	if err != nil {
		if st, ok := status.FromError(err); ok {
			return nil, st.Err()
		}
		return nil, status.Errorf(codes.Unauthenticated, "idemgrpc: %v", err)
	}
	if user == "" {
		return nil, status.Error(codes.Unauthenticated, "idemgrpc: no user for the idempotency key")
	}

	// This call's own run of the handler, if it ran: its answer is
	// returned as the handler gave it.
	var (
		ran              bool
		firstResp        any
		firstErr         error
		handlerRetryable bool // idem.Do's error is the handler's
	)
	res, err := idem.Do(ctx, s.store, idem.DoParams{
		User:         user,
		Key:          key,
		Operation:    info.FullMethod,
		Input:        input,
		Lease:        s.opts.Lease,
		TTL:          s.opts.TTL,
		InFlightWait: s.opts.InFlightWait,
		Logger:       s.opts.Logger,
		Metrics:      s.opts.Metrics,
	}, func(ctx context.Context, _ []byte) ([]byte, error) {
		resp, herr := handler(ctx, req)
		out, retryable, err := s.outcome(info.FullMethod, newResp, resp, herr)
		if err != nil {
			handlerRetryable = retryable
			return nil, err
		}
		ran, firstResp, firstErr = true, resp, herr
		return out, nil
	})
	switch {
	case err != nil && handlerRetryable:
		return nil, err // the handler's error, a code that leaves the key retryable
	case err != nil:
		return nil, s.answerError(ctx, info.FullMethod, err)
	case !res.Replayed && ran:
		if firstErr != nil {
			return nil, firstErr
		}
		return firstResp, nil
	}
	_ = grpc.SetHeader(ctx, metadata.Pairs(ReplayedMetadata, "true"))
	return replay(info.FullMethod, newResp, res.Output)
}

// count adds to the caller's metrics, if any.
func (s *server) count(f func(*idem.Metrics)) {
	if s.opts.Metrics != nil {
		f(s.opts.Metrics)
	}
}

// keyOf reads the call's idempotency key: present is false without one;
// more than one, or one idem.ParseKey refuses, is an error.
func keyOf(ctx context.Context) (key string, present bool, err error) {
	md, _ := metadata.FromIncomingContext(ctx)
	vs := md.Get(KeyMetadata)
	switch len(vs) {
	case 0:
		return "", false, nil
	case 1:
	default:
		return "", true, fmt.Errorf("%w: %d %s entries, want one", idem.ErrKeyInvalid, len(vs), KeyMetadata)
	}
	k, err := idem.ParseKey(vs[0])
	if err != nil {
		return "", true, err
	}
	return k, true, nil
}

// outcome returns what is stored of the handler's answer (resp, herr):
// the encoding of a google.rpc.Status (see decodeStatus), or, for a code
// that Options.Stored leaves retryable, herr itself and retryable set
// (idem.Do then rolls the handler's writes back and keeps the key
// retryable). An answer it cannot store is an Internal error.
func (s *server) outcome(method string, newResp func() proto.Message, resp any, herr error) (out []byte, retryable bool, err error) {
	var st *spb.Status
	if herr != nil {
		p := status.Convert(herr).Proto()
		if !s.opts.Stored(codes.Code(p.GetCode())) {
			return nil, true, herr
		}
		st = p
	} else {
		msg, ok := resp.(proto.Message)
		if !ok {
			return nil, false, status.Errorf(codes.Internal, "idemgrpc: response of %s is a %T, not a proto.Message", method, resp)
		}
		want := newResp().ProtoReflect().Descriptor().FullName()
		if got := msg.ProtoReflect().Descriptor().FullName(); got != want {
			s.opts.Logger.Error("idemgrpc: the handler's response is not of the type Options.Methods builds", "method", method, "response", got, "methods", want)
			return nil, false, status.Errorf(codes.Internal, "idemgrpc: %s answered a %s, Options.Methods builds a %s", method, got, want)
		}
		enc, merr := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
		if merr != nil {
			return nil, false, status.Errorf(codes.Internal, "idemgrpc: encoding the response: %v", merr)
		}
		st = &spb.Status{Details: []*anypb.Any{{TypeUrl: "type.googleapis.com/" + string(want), Value: enc}}}
	}
	out, err = proto.MarshalOptions{Deterministic: true}.Marshal(st)
	if err != nil {
		return nil, false, status.Errorf(codes.Internal, "idemgrpc: encoding the status: %v", err)
	}
	return out, false, nil
}

// decodeStatus reads a stored answer: a google.rpc.Status in
// deterministic encoding. For OK its one detail is the response message
// (an Any: the type's URL and the message's deterministic encoding);
// for any other code it is the handler's status, details and all.
func decodeStatus(out []byte) (*spb.Status, error) {
	st := new(spb.Status)
	if err := proto.Unmarshal(out, st); err != nil {
		return nil, status.Errorf(codes.Internal, "idemgrpc: the stored answer is unreadable: %v", err)
	}
	if st.GetCode() == int32(codes.OK) && len(st.GetDetails()) != 1 {
		return nil, status.Errorf(codes.Internal, "idemgrpc: the stored answer holds %d messages, want 1", len(st.GetDetails()))
	}
	return st, nil
}

// replay returns the stored answer out: its status as an error, or, for
// OK, its message unmarshalled into a new message of newResp's type.
func replay(method string, newResp func() proto.Message, out []byte) (any, error) {
	st, err := decodeStatus(out)
	if err != nil {
		return nil, err
	}
	if st.GetCode() != int32(codes.OK) {
		return nil, status.FromProto(st).Err()
	}
	msg := newResp()
	if err := proto.Unmarshal(st.GetDetails()[0].GetValue(), msg); err != nil {
		return nil, status.Errorf(codes.Internal, "idemgrpc: the stored response of %s is not a %s: %v", method, msg.ProtoReflect().Descriptor().FullName(), err)
	}
	return msg, nil
}

// answerError turns idem.Do's error into the call's status: the
// protocol's answers as the package documentation's table says, the
// handler's own error (a retryable code) as it is.
func (s *server) answerError(ctx context.Context, method string, err error) error {
	var ife *idem.InFlightError
	switch {
	case errors.Is(err, idem.ErrFingerprintMismatch):
		return withInfo(codes.InvalidArgument, "idemgrpc: the idempotency key was first used with another method or request; use a new key for a new request", ReasonKeyReused, method)
	case errors.Is(err, idem.ErrInFlight), errors.Is(err, idem.ErrFenced):
		secs := 1
		if errors.As(err, &ife) {
			if left := time.Until(ife.LeaseUntil).Seconds(); left > 0 && left < 1 {
				secs = int(math.Ceil(left))
			}
		}
		// In the trailer: a header would make the answer other than
		// Trailers-Only, which gRPC's retry policy never retries.
		_ = grpc.SetTrailer(ctx, metadata.Pairs(RetryAfterMetadata, strconv.Itoa(secs)))
		st, derr := status.New(codes.Aborted, "idemgrpc: a call with this idempotency key is still in flight; retry later with the same key").
			WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Duration(secs) * time.Second)})
		if derr != nil {
			return status.Error(codes.Aborted, "idemgrpc: a call with this idempotency key is still in flight")
		}
		return st.Err()
	case errors.Is(err, idem.ErrStoreUnavailable):
		return status.Error(codes.Unavailable, "idemgrpc: idempotency store unavailable; retry with the same key")
	case errors.Is(err, idem.ErrHandlerPanicked):
		return status.Error(codes.Internal, "idemgrpc: the handler panicked; nothing was stored, and the same call may be retried with the same key")
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err).Err()
	}
	if st, ok := status.FromError(err); ok {
		return st.Err() // the interceptor's own (outcome's) Internal
	}
	s.opts.Logger.ErrorContext(ctx, "idemgrpc: idem.Do failed", "err", err)
	return status.Errorf(codes.Internal, "idemgrpc: %v", err)
}

// withInfo is a status of code with msg and an ErrorInfo detail of
// reason.
func withInfo(code codes.Code, msg, reason, method string) error {
	info := &errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain}
	if method != "" {
		info.Metadata = map[string]string{"method": method}
	}
	st, err := status.New(code, msg).WithDetails(info)
	if err != nil {
		return status.Error(code, msg)
	}
	return st.Err()
}
