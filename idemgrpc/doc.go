// Package idemgrpc is the library's guarantee for gRPC: unary methods
// whose calls carry an idempotency key run once per key, their writes
// committing with the stored answer, as the HTTP middleware does for
// HTTP requests. It is a module of its own, so that google.golang.org/grpc
// never enters the root module's graph.
//
// # Server
//
// UnaryServerInterceptor runs each call of an opted-in method
// (Options.Methods) through idem.Do with:
//
//   - key: the call's idempotency-key metadata entry (KeyMetadata), read
//     with idem.ParseKey, so with the HTTP header's syntax and bounds (1
//     to 255 characters of visible ASCII, bare or as an RFC 8941
//     sf-string). A bad key, or more than one, is InvalidArgument
//     (ReasonKeyInvalid). A call without a key is InvalidArgument
//     (ReasonKeyMissing), or, with Options.OptionalKey, runs unprotected.
//     Other methods pass through untouched.
//   - user: Options.User(ctx), required: a key belongs to one user.
//   - fingerprint: idem.Do's over the operation, the full method name,
//     and the input, the request message's deterministic protobuf
//     encoding (proto.MarshalOptions{Deterministic: true}) without the
//     fields its type does not know: their bytes are the client's, in
//     no set order (a map's entries), and the handler does not read
//     them. So a request whose known fields are the same is the same
//     request; across two versions of the request type, one that sets
//     a field only one of them knows is another request on the other.
//
// The handler runs with idem.Do's context: idem.TxFromContext, and the
// stores' accessors (pgstore.FromContext, memstore.FromContext, …),
// give it the call's transaction, in which its writes commit together
// with the stored answer, or roll back, as an HTTP handler's do. It must
// not commit it.
//
// # Answers
//
// The stored answer is a google.rpc.Status in deterministic encoding:
// for OK, the response message's deterministic encoding (in an Any); for
// an error, its code, message and details. A replay does not run the
// handler: it unmarshals the stored message into a new message of the
// type Options.Methods builds for the method (or returns the stored
// status), with response header metadata idempotent-replayed: true. A
// stored message of another type (stored by a server that answers the
// method with another) is not read as this one: the answer is Internal.
// Header and trailer metadata the handler sets (grpc.SetHeader,
// grpc.SetTrailer) are not stored: a replay carries none of them, so an
// answer a client needs to read again belongs in the message.
//
//	handler's answer                       stored  writes   a repeat of the key, same request
//	OK                                     yes     commit   replays it
//	InvalidArgument, NotFound,             yes     commit   replays it (a final answer to the
//	  AlreadyExists, FailedPrecondition,                      request, as HTTP's 402)
//	  OutOfRange, Unimplemented
//	Canceled, Unknown, DeadlineExceeded,   no      roll     runs the handler again (as after
//	  PermissionDenied, ResourceExhausted,         back     HTTP's 5xx: the key stays bound
//	  Aborted, Internal, Unavailable,                       to its request, so another
//	  DataLoss, Unauthenticated                             request with it is refused)
//	a panic                                no      roll     Internal; runs again
//	                                               back
//
// Options.Stored changes the error codes stored (StoredCode is the
// default). The retryable codes are transient or depend on what the
// request does not carry (credentials, quotas, the deadline). A plain Go
// error is Unknown, as gRPC answers it (a context's error Canceled or
// DeadlineExceeded); so is an error whose status is OK, which has no
// response to store.
//
// The interceptor's own answers, the handler not running:
//
//	case                                   code
//	same key, another method or request    InvalidArgument, ErrorInfo reason IDEMPOTENCY_KEY_REUSED
//	a call with the key still in flight    Aborted, RetryInfo detail, trailer retry-after: seconds
//	  (after Options.InFlightWait)
//	the attempt lost its lease (fenced)    Aborted, as in flight (its writes rolled back)
//	the store is down                      Unavailable
//	missing or bad key                     InvalidArgument, ErrorInfo reason IDEMPOTENCY_KEY_MISSING / _INVALID
//
// The Aborted and Unavailable answers set no header metadata: gRPC
// retries (a service config's retryPolicy) only a Trailers-Only answer,
// so retry-after is in the trailer. For the same reason the key is not
// echoed back. Unlike the HTTP middleware's refusals before anything
// happened (other 4xx on a first attempt), no answer frees a key: a
// corrected request needs a new key.
//
// An attempt that crashes leaves its key claimed until its lease runs
// out; then a retry runs it again, or a completer does (below).
//
// # Finishing abandoned calls
//
// A call whose server died after it claimed its key (or whose handler
// answered a retryable code) can be finished without its client: give
// an idem.Completer the functions of CompleterFuncs, which run a
// method's handler again with the request the key's record keeps and
// store its answer as the interceptor would. The client's retry then
// replays it, through this interceptor or the Connect one:
//
//	funcs := idemgrpc.CompleterFuncs(&shoppb.Orders_ServiceDesc, ordersServer, opts, authz) // opts: the interceptor's; authz: the interceptors inside it
//	c := idem.NewCompleter(store, nil, idem.CompleterOptions{Funcs: funcs, Middleware: idem.Options{Lease: opts.Lease, TTL: opts.TTL}})
//	go c.Run(ctx)
//
// (For several services, merge their maps; for Connect, see
// idemconnect.CompleterFunc.) A re-drive calls the implementation's
// method without the server: no incoming metadata, no peer, and only the
// interceptors given to CompleterFuncs: give it those that run inside
// this one (an authorization check, a quota), or a call one of them
// refused with a retryable code is run by the completer unchecked. The
// handler must not depend on the metadata or the peer: it
// learns its user, the one Options.User named for the call, from
// idem.LeaseFromContext(ctx) (the lease's User), in a call and in a
// re-drive alike, and writes through the attempt's transaction as in a
// call. The completer claims the key as a retry would: a call in flight
// is left alone, and the handler's writes commit once.
//
// # Connect
//
// Package idemgrpc/idemconnect is the same server interceptor for
// Connect (connectrpc.com/connect), a connect.Interceptor. Both share
// one implementation (the key and user rules, the code table, the call
// of idem.Do) and store one format under one operation name (the full
// method name is Connect's procedure), so they share one key space: a
// key first used through this interceptor replays through the Connect
// one on the same store, and the reverse, as a Connect handler also
// serves gRPC clients. Give both the same store and Options.User
// functions that name a caller alike.
//
// # Client
//
// UnaryClientInterceptor puts one key on each call's outgoing metadata
// (the caller's own, WithKey's, or a new one) and keeps it across gRPC's
// retries; WithKey keeps one key across the caller's own retries.
package idemgrpc
