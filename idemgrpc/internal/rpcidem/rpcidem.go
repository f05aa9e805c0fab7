// Package rpcidem is what the gRPC interceptor (idemgrpc) and the
// Connect one (idemgrpc/idemconnect) share: the names on the wire, the
// table of stored codes, the reading of the key and the user, the call
// of idem.Do and the stored answer's format (a google.rpc.Status in
// deterministic encoding). One format and one operation name (the full
// method name, which is Connect's procedure) make one key space: a key
// first used through one interceptor replays through the other on the
// same store.
//
// It knows neither protocol: a Protocol converts between its errors and
// google.rpc.Status, and the caller writes the Answer's header and
// trailer metadata its own way.
package rpcidem

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"time"

	"github.com/idem-go/idem"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
)

// Names on the wire, the same for both protocols (see idemgrpc's
// exported constants of the same names).
const (
	KeyMetadata        = "idempotency-key"
	ReplayedMetadata   = "idempotent-replayed"
	RetryAfterMetadata = "retry-after"

	ErrorDomain      = "idem-go.github.io"
	ReasonKeyReused  = "IDEMPOTENCY_KEY_REUSED"
	ReasonKeyMissing = "IDEMPOTENCY_KEY_MISSING"
	ReasonKeyInvalid = "IDEMPOTENCY_KEY_INVALID"
)

// The status codes this package answers or reads: gRPC's numbers, which
// Connect's codes share.
const (
	OK                 uint32 = 0
	Canceled           uint32 = 1
	Unknown            uint32 = 2
	InvalidArgument    uint32 = 3
	DeadlineExceeded   uint32 = 4
	NotFound           uint32 = 5
	AlreadyExists      uint32 = 6
	FailedPrecondition uint32 = 9
	Aborted            uint32 = 10
	OutOfRange         uint32 = 11
	Unimplemented      uint32 = 12
	Internal           uint32 = 13
	Unavailable        uint32 = 14
	Unauthenticated    uint32 = 16
)

// StoredCode is the default table of stored codes: OK and the codes that
// are a final answer to the request itself. See idemgrpc.StoredCode.
func StoredCode(c uint32) bool {
	switch c {
	case OK, InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, OutOfRange, Unimplemented:
		return true
	}
	return false
}

// Check panics, with a message that starts with ctor and names what is
// wrong, on options no interceptor can work with: a nil store, no user
// function (userSet false), no methods, a method name that is not
// "/service/method" or whose function is nil (methods maps each name to
// whether its function is set), a negative duration, or a lease (or its
// default) not shorter than the TTL (or its default).
func Check(ctor string, store idem.Store, userSet bool, methods map[string]bool, lease, ttl, wait time.Duration) {
	if store == nil {
		panic(ctor + ": nil Store")
	}
	if !userSet {
		panic(ctor + ": Options.User is nil: give the function that names the caller " +
			"(a key belongs to one user: without it, anyone who sends another caller's key and request gets that caller's stored answer)")
	}
	if len(methods) == 0 {
		panic(ctor + ": no Options.Methods: name the methods to make idempotent")
	}
	for m, set := range methods {
		if !ValidMethod(m) {
			panic(fmt.Sprintf("%s: Options.Methods key %q is not a full method name (/service/method, at most %d bytes, no control characters)", ctor, m, idem.MaxKeyLength))
		}
		if !set {
			panic(fmt.Sprintf("%s: Options.Methods[%q] is nil", ctor, m))
		}
	}
	if lease < 0 || ttl < 0 || wait < 0 {
		panic(ctor + ": negative Lease, TTL or InFlightWait (zero means the default)")
	}
	if lease == 0 {
		lease = idem.DefaultLease
	}
	if ttl == 0 {
		ttl = idem.DefaultTTL
	}
	if lease >= ttl {
		panic(fmt.Sprintf("%s: Lease %v not shorter than TTL %v", ctor, lease, ttl))
	}
}

// ValidMethod reports whether m is a full method name that idem.Do takes
// as an operation's name.
func ValidMethod(m string) bool {
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

// Protocol is what differs between gRPC and Connect.
type Protocol struct {
	// Name starts the messages of the interceptor's own answers and logs
	// ("idemgrpc", "idemconnect").
	Name string
	// KeyCarrier names where the key travels, for the answer to a call
	// without one ("metadata entry", "header").
	KeyCarrier string
	// Status returns the status err carries, ok false if it carries none
	// of the protocol's (a plain Go error).
	Status func(err error) (st *spb.Status, ok bool)
	// Error returns st, whose code is not OK, as the protocol's error.
	Error func(st *spb.Status) error
}

// Server is one interceptor's settings, its defaults filled in (Stored
// and Logger set).
type Server struct {
	Store                    idem.Store
	Protocol                 Protocol
	OptionalKey              bool
	Stored                   func(code uint32) bool
	Lease, TTL, InFlightWait time.Duration
	Logger                   *slog.Logger
	Metrics                  *idem.Metrics
}

// Call is one call of an opted-in method.
type Call struct {
	// Method is the full method name ("/pkg.Service/Method").
	Method string
	// Keys are the call's values of KeyMetadata.
	Keys []string
	// Req is the request message.
	Req any
	// NewResp returns a new message of the method's response type.
	NewResp func() proto.Message
	// User returns the call's user (Options.User).
	User func() (string, error)
	// Run runs the handler with ctx: its answer resp, returned as it is,
	// the response message in it (msg; resp itself for gRPC) and its
	// error.
	Run func(ctx context.Context) (resp, msg any, err error)
}

// Answer is what the interceptor answers a call.
type Answer struct {
	// Resp, without Err: the handler's own answer (Run's resp) or,
	// Replayed, a new message of NewResp's type holding the stored one.
	Resp any
	// Err: the handler's own error, a stored one (Replayed), or the
	// interceptor's own answer, in the protocol's errors.
	Err error
	// Replayed: the answer is the stored one; the caller sets
	// ReplayedMetadata: true in the response header.
	Replayed bool
	// RetryAfter, if above zero, is the seconds the caller sends as
	// RetryAfterMetadata (Aborted: a call with the key is in flight).
	RetryAfter int
}

// Serve answers c: it runs c.Run once per key through idem.Do, or
// replays the stored answer, or refuses.
func (s *Server) Serve(ctx context.Context, c Call) Answer {
	key, present, err := keyOf(c.Keys)
	if err != nil {
		s.count(func(m *idem.Metrics) { m.Invalid.Add(1) })
		return Answer{Err: s.withInfo(InvalidArgument, err.Error(), ReasonKeyInvalid, c.Method)}
	}
	if !present {
		if s.OptionalKey {
			s.count(func(m *idem.Metrics) { m.Unprotected.Add(1) })
			resp, _, herr := c.Run(ctx)
			return Answer{Resp: resp, Err: herr}
		}
		s.count(func(m *idem.Metrics) { m.Invalid.Add(1) })
		return Answer{Err: s.withInfo(InvalidArgument, s.Protocol.Name+": this method needs an "+KeyMetadata+" "+s.Protocol.KeyCarrier, ReasonKeyMissing, c.Method)}
	}
	msg, ok := c.Req.(proto.Message)
	if !ok {
		return Answer{Err: s.errorf(Internal, "request of %s is a %T, not a proto.Message", c.Method, c.Req)}
	}
	input, err := Fingerprinted(msg)
	if err != nil {
		return Answer{Err: s.errorf(Internal, "encoding the request: %v", err)}
	}
	user, err := c.User()
	if err != nil {
		if _, ok := s.Protocol.Status(err); ok {
			return Answer{Err: err}
		}
		return Answer{Err: s.errorf(Unauthenticated, "%v", err)}
	}
	if user == "" {
		return Answer{Err: s.errorf(Unauthenticated, "no user for the idempotency key")}
	}

	// This call's own run of the handler, if it ran: its answer is
	// returned as the handler gave it.
	var (
		ran              bool
		first            Answer
		handlerRetryable bool // idem.Do's error is the handler's
	)
	res, err := idem.Do(ctx, s.Store, idem.DoParams{
		User:         user,
		Key:          key,
		Operation:    c.Method,
		Input:        input,
		Lease:        s.Lease,
		TTL:          s.TTL,
		InFlightWait: s.InFlightWait,
		Logger:       s.Logger,
		Metrics:      s.Metrics,
	}, func(ctx context.Context, _ []byte) ([]byte, error) {
		resp, msg, herr := c.Run(ctx)
		out, retryable, err := s.outcome(c.Method, c.NewResp, msg, herr)
		if err != nil {
			handlerRetryable = retryable
			return nil, err
		}
		ran, first = true, Answer{Resp: resp, Err: herr}
		return out, nil
	})
	switch {
	case err != nil && handlerRetryable:
		return Answer{Err: err} // the handler's error, a code that leaves the key retryable
	case err != nil:
		return s.answerError(ctx, c.Method, err)
	case !res.Replayed && ran:
		return first
	}
	a := s.replay(c.Method, c.NewResp, res.Output)
	a.Replayed = true
	return a
}

// count adds to the caller's metrics, if any.
func (s *Server) count(f func(*idem.Metrics)) {
	if s.Metrics != nil {
		f(s.Metrics)
	}
}

// keyOf reads the call's idempotency key from its entries: present is
// false without one; more than one, or one idem.ParseKey refuses, is an
// error.
func keyOf(vs []string) (key string, present bool, err error) {
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

// outcome returns what is stored of the handler's answer (its response
// message msg, its error herr): the encoding of a google.rpc.Status (see
// DecodeStatus), or, for a code that Stored leaves retryable, herr
// itself and retryable set (idem.Do then rolls the handler's writes back
// and keeps the key retryable). An answer it cannot store is an Internal
// error. A plain Go error is judged by the code both protocols answer it
// with: Canceled or DeadlineExceeded for a context's error, else
// Unknown; so is an error whose status is OK.
func (s *Server) outcome(method string, newResp func() proto.Message, msg any, herr error) (out []byte, retryable bool, err error) {
	var st *spb.Status
	if herr != nil {
		p, ok := s.Protocol.Status(herr)
		switch {
		case !ok && errors.Is(herr, context.Canceled):
			p = &spb.Status{Code: int32(Canceled), Message: herr.Error()}
		case !ok && errors.Is(herr, context.DeadlineExceeded):
			p = &spb.Status{Code: int32(DeadlineExceeded), Message: herr.Error()}
		case !ok || p.GetCode() == int32(OK):
			// An error whose status is OK has no response to store:
			// Unknown, as a plain error.
			p = &spb.Status{Code: int32(Unknown), Message: herr.Error()}
		}
		if !s.Stored(uint32(p.GetCode())) {
			return nil, true, herr
		}
		st = p
	} else {
		m, ok := msg.(proto.Message)
		if !ok {
			return nil, false, s.errorf(Internal, "response of %s is a %T, not a proto.Message", method, msg)
		}
		want := newResp().ProtoReflect().Descriptor().FullName()
		if got := m.ProtoReflect().Descriptor().FullName(); got != want {
			s.Logger.Error(s.Protocol.Name+": the handler's response is not of the type Options.Methods builds", "method", method, "response", got, "methods", want)
			return nil, false, s.errorf(Internal, "%s answered a %s, Options.Methods builds a %s", method, got, want)
		}
		enc, merr := proto.MarshalOptions{Deterministic: true}.Marshal(m)
		if merr != nil {
			return nil, false, s.errorf(Internal, "encoding the response: %v", merr)
		}
		st = &spb.Status{Details: []*anypb.Any{{TypeUrl: TypeURL(m), Value: enc}}}
	}
	out, err = proto.MarshalOptions{Deterministic: true}.Marshal(st)
	if err != nil {
		return nil, false, s.errorf(Internal, "encoding the status: %v", err)
	}
	return out, false, nil
}

// TypeURL is the type URL of m's type in the stored answer's Any.
func TypeURL(m proto.Message) string {
	return "type.googleapis.com/" + string(m.ProtoReflect().Descriptor().FullName())
}

// Fingerprinted is the input idem.Do fingerprints for the request msg:
// its deterministic encoding without the fields its type does not know.
// Those are kept as the client encoded them, which is not deterministic
// (a map's entries in any order), so the same request sent again could
// otherwise be refused as another; and the handler, which does not know
// them either, answers alike whatever they hold.
func Fingerprinted(msg proto.Message) ([]byte, error) {
	det := proto.MarshalOptions{Deterministic: true}
	b, err := det.Marshal(msg)
	if err != nil || !HasUnknown(b, msg.ProtoReflect().Descriptor()) {
		return b, err
	}
	// A copy without its unknown fields, not a decoding of b: that would
	// resolve extensions with the global registry, not with what decoded
	// msg, and lose the ones it lacks.
	known := proto.Clone(msg)
	discardUnknown(known.ProtoReflect())
	return det.Marshal(known)
}

// discardUnknown drops the unknown fields of m and of every message in
// it, its extensions' too.
func discardUnknown(m protoreflect.Message) {
	forEachMessage(m, func(m protoreflect.Message) {
		if m.GetUnknown() != nil {
			m.SetUnknown(nil)
		}
	})
}

// forEachMessage calls f with m, then with every message in it (in its
// fields, lists, map values and extensions), depth first.
func forEachMessage(m protoreflect.Message, f func(protoreflect.Message)) {
	f(m)
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsList() && fd.Message() != nil:
			for i, l := 0, v.List(); i < l.Len(); i++ {
				forEachMessage(l.Get(i).Message(), f)
			}
		case fd.IsMap() && fd.MapValue().Message() != nil:
			v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
				forEachMessage(mv.Message(), f)
				return true
			})
		case !fd.IsList() && !fd.IsMap() && fd.Message() != nil:
			forEachMessage(v.Message(), f)
		}
		return true
	})
}

// HasUnknown reports whether b, an encoding of a message of md's type,
// holds a field md does not know, in it or in a message in it: a field
// number md lacks (an extension too), or a known number with a wire type
// the field cannot take, which a decoder keeps as unknown. It reads the
// encoding once, groups and all, with no allocation; an encoding it
// cannot parse counts as holding one, so that the caller decodes it
// properly.
func HasUnknown(b []byte, md protoreflect.MessageDescriptor) bool {
	_, unknown := scan(b, md, 0)
	return unknown
}

// scan reads the fields of a message of md's type from b: all of b, or,
// for a group's (group its field's number), up to its end-group tag. It
// returns the bytes read, that tag included, and whether a field md does
// not know (or bytes it cannot parse) came first.
func scan(b []byte, md protoreflect.MessageDescriptor, group protowire.Number) (int, bool) {
	start := len(b)
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return 0, true
		}
		b = b[n:]
		if typ == protowire.EndGroupType {
			return start - len(b), group == 0 || num != group
		}
		fd := md.Fields().ByNumber(num)
		if fd == nil || !wireTypeOK(fd, typ) {
			return 0, true
		}
		switch fd.Kind() {
		case protoreflect.MessageKind:
			v, m := protowire.ConsumeBytes(b)
			if m < 0 || HasUnknown(v, fd.Message()) {
				return 0, true
			}
			n = m
		case protoreflect.GroupKind:
			m, unknown := scan(b, fd.Message(), num)
			if unknown {
				return 0, true
			}
			n = m
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return 0, true
		}
		b = b[n:]
	}
	return start, group != 0 // a group without its end
}

// wireTypeOK reports whether a field fd may come with wire type typ: its
// kind's, or, for a repeated scalar, the packed form's.
func wireTypeOK(fd protoreflect.FieldDescriptor, typ protowire.Type) bool {
	var want protowire.Type
	switch fd.Kind() {
	case protoreflect.MessageKind, protoreflect.StringKind, protoreflect.BytesKind:
		return typ == protowire.BytesType
	case protoreflect.GroupKind:
		return typ == protowire.StartGroupType
	case protoreflect.Fixed32Kind, protoreflect.Sfixed32Kind, protoreflect.FloatKind:
		want = protowire.Fixed32Type
	case protoreflect.Fixed64Kind, protoreflect.Sfixed64Kind, protoreflect.DoubleKind:
		want = protowire.Fixed64Type
	default: // bool, enum and the varint integers
		want = protowire.VarintType
	}
	return typ == want || (fd.IsList() && typ == protowire.BytesType)
}

// DecodeStatus reads a stored answer: a google.rpc.Status in
// deterministic encoding. For OK its one detail is the response message
// (an Any: the type's URL and the message's deterministic encoding); for
// any other code it is the handler's status, details and all.
func DecodeStatus(out []byte) (*spb.Status, error) {
	st := new(spb.Status)
	if err := proto.Unmarshal(out, st); err != nil {
		return nil, fmt.Errorf("the stored answer is unreadable: %w", err)
	}
	if st.GetCode() == int32(OK) && len(st.GetDetails()) != 1 {
		return nil, fmt.Errorf("the stored answer holds %d messages, want 1", len(st.GetDetails()))
	}
	return st, nil
}

// replay returns the stored answer out: its status as an error, or, for
// OK, its message unmarshalled into a new message of newResp's type.
func (s *Server) replay(method string, newResp func() proto.Message, out []byte) Answer {
	st, err := DecodeStatus(out)
	if err != nil {
		return Answer{Err: s.errorf(Internal, "%v", err)}
	}
	if st.GetCode() != int32(OK) {
		return Answer{Err: s.Protocol.Error(st)}
	}
	msg := newResp()
	// The stored message must be of the type msg is: the bytes of
	// another would read as garbage (protobuf's encoding does not name
	// its type), if a server on the same store, or an earlier version of
	// this one, answers the method with another.
	if want, got := TypeURL(msg), st.GetDetails()[0].GetTypeUrl(); got != want {
		s.Logger.Error(s.Protocol.Name+": the stored response is not of the type Options.Methods builds", "method", method, "stored", got, "methods", want)
		return Answer{Err: s.errorf(Internal, "the stored response of %s is a %s, Options.Methods builds a %s", method, got, want)}
	}
	if err := proto.Unmarshal(st.GetDetails()[0].GetValue(), msg); err != nil {
		return Answer{Err: s.errorf(Internal, "the stored response of %s is not a %s: %v", method, msg.ProtoReflect().Descriptor().FullName(), err)}
	}
	return Answer{Resp: msg}
}

// answerError turns idem.Do's error into the call's answer: the
// protocol's answers as idemgrpc's documentation's table says, the
// interceptor's own (outcome's) errors as they are.
func (s *Server) answerError(ctx context.Context, method string, err error) Answer {
	var ife *idem.InFlightError
	switch {
	case errors.Is(err, idem.ErrFingerprintMismatch):
		return Answer{Err: s.withInfo(InvalidArgument, s.Protocol.Name+": the idempotency key was first used with another method or request; use a new key for a new request", ReasonKeyReused, method)}
	case errors.Is(err, idem.ErrInFlight), errors.Is(err, idem.ErrFenced):
		secs := 1
		if errors.As(err, &ife) {
			if left := time.Until(ife.LeaseUntil).Seconds(); left > 0 && left < 1 {
				secs = int(math.Ceil(left))
			}
		}
		st := &spb.Status{Code: int32(Aborted), Message: s.Protocol.Name + ": a call with this idempotency key is still in flight; retry later with the same key"}
		if d, derr := anypb.New(&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Duration(secs) * time.Second)}); derr == nil {
			st.Details = []*anypb.Any{d}
		}
		return Answer{Err: s.Protocol.Error(st), RetryAfter: secs}
	case errors.Is(err, idem.ErrStoreUnavailable):
		return Answer{Err: s.errorf(Unavailable, "idempotency store unavailable; retry with the same key")}
	case errors.Is(err, idem.ErrHandlerPanicked):
		return Answer{Err: s.errorf(Internal, "the handler panicked; nothing was stored, and the same call may be retried with the same key")}
	case errors.Is(err, context.Canceled):
		return Answer{Err: s.Protocol.Error(&spb.Status{Code: int32(Canceled), Message: err.Error()})}
	case errors.Is(err, context.DeadlineExceeded):
		return Answer{Err: s.Protocol.Error(&spb.Status{Code: int32(DeadlineExceeded), Message: err.Error()})}
	}
	if _, ok := s.Protocol.Status(err); ok {
		return Answer{Err: err} // the interceptor's own (outcome's) Internal
	}
	s.Logger.ErrorContext(ctx, s.Protocol.Name+": idem.Do failed", "err", err)
	return Answer{Err: s.errorf(Internal, "%v", err)}
}

// errorf is the protocol's error of code with a message that starts with
// the protocol's name.
func (s *Server) errorf(code uint32, format string, args ...any) error {
	return s.Protocol.Error(&spb.Status{Code: int32(code), Message: s.Protocol.Name + ": " + fmt.Sprintf(format, args...)})
}

// withInfo is the protocol's error of code with msg and an ErrorInfo
// detail of reason.
func (s *Server) withInfo(code uint32, msg, reason, method string) error {
	info := &errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain}
	if method != "" {
		info.Metadata = map[string]string{"method": method}
	}
	st := &spb.Status{Code: int32(code), Message: msg}
	if d, err := anypb.New(info); err == nil {
		st.Details = []*anypb.Any{d}
	}
	return s.Protocol.Error(st)
}
