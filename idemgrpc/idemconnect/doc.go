// Package idemconnect is the library's guarantee for Connect
// (connectrpc.com/connect): unary procedures whose calls carry an
// idempotency key run once per key, their writes committing with the
// stored answer. It is idemgrpc's server interceptor as a
// connect.Interceptor (NewInterceptor; its WrapUnary, streams pass
// through untouched), with the same behaviour: read idemgrpc's
// documentation for the tables of what is stored, what is retryable and
// what the interceptor answers itself; Connect's codes are gRPC's
// (connect.CodeAborted is codes.Aborted, and so on).
//
// # One key space with idemgrpc
//
// Both interceptors store the same answer, a google.rpc.Status in
// deterministic encoding (OK: the response message in an Any), under the
// same operation name (the procedure, "/pkg.Service/Method", which is
// gRPC's full method name) and the same fingerprint (the request's
// deterministic protobuf encoding, without the fields its type does not
// know). So a key first used through
// idemgrpc's interceptor replays through this one on the same store, and
// the reverse: a Connect handler also serves the gRPC and gRPC-Web
// protocols, and a service moving from grpc-go to connect-go, or serving
// both during the move, keeps its keys. Only the store, the user and the
// key must agree: give both interceptors the same store and Options.User
// functions that name a caller alike.
//
// # On the wire
//
//   - key: the request header idempotency-key (Idempotency-Key: HTTP
//     header names are case-insensitive; gRPC's metadata entry of
//     idemgrpc), with the HTTP header's syntax (idem.ParseKey). A bad
//     key, or more than one, is CodeInvalidArgument (ReasonKeyInvalid);
//     none is CodeInvalidArgument (ReasonKeyMissing), or, with
//     Options.OptionalKey, the call runs unprotected.
//   - replay: the response header idempotent-replayed: true, for a
//     replayed error too (set through connect.CallInfoForHandlerContext,
//     so a header in every protocol, as idemgrpc's; a Connect client
//     finds it in connect.Error.Meta).
//   - in flight (and a fenced attempt): connect.CodeAborted with a
//     google.rpc.RetryInfo detail and retry-after: seconds in the error's
//     metadata (a response header over the Connect protocol, a trailer
//     over gRPC's). A gRPC client's retry policy (a service config's
//     retryPolicy) retries only a Trailers-Only answer, and connect-go on
//     net/http sends its gRPC errors after a response header of their
//     own: serve the handler through TrailersOnly, which makes such an
//     error Trailers-Only, so that a policy listing ABORTED retries it
//     with the same key until the first call's answer replays. Without
//     it, such clients retry with the same key themselves
//     (idemgrpc.WithKey), or the interceptor is given an InFlightWait, so
//     that a repeat waits for the call in flight and replays it.
//   - the key reused with another procedure or request:
//     connect.CodeInvalidArgument with a google.rpc.ErrorInfo detail of
//     reason IDEMPOTENCY_KEY_REUSED (connect.ErrorDetail).
//   - the store down: connect.CodeUnavailable; the handler does not run.
//
// The handler runs with idem.Do's context: idem.TxFromContext and the
// stores' accessors (pgstore.FromContext, memstore.FromContext, …) give
// it the call's transaction, which it must not commit.
//
// A stored error replays as a *connect.Error with the handler's code,
// message and details; a handler's plain Go error is CodeUnknown, as
// Connect answers it (a context's error CodeCanceled or
// CodeDeadlineExceeded), and so retryable.
//
// # Finishing abandoned calls
//
// CompleterFunc is idemgrpc.CompleterFuncs for one procedure: the
// function with which an idem.Completer runs the procedure's handler
// again, with the request the key's record keeps, for a call whose
// server died after it claimed its key (or whose handler answered a
// retryable code). Its answer is stored as the interceptor would store
// it, so the client's retry replays it, through this interceptor or
// idemgrpc's:
//
//	c := idem.NewCompleter(store, nil, idem.CompleterOptions{
//		Funcs: map[string]idem.DoFunc{
//			shopv1connect.OrdersCreateProcedure: idemconnect.CompleterFunc(shopv1connect.OrdersCreateProcedure, orders.Create, opts), // opts: the interceptor's
//		},
//		Middleware: idem.Options{Lease: opts.Lease, TTL: opts.TTL},
//	})
//	go c.Run(ctx)
//
// A re-drive calls the handler alone, with connect.NewRequest's request:
// no header, no peer, a zero Spec, none of the handler's interceptors.
// Give it a handler that also makes the checks of the interceptors that
// run inside this one (authorization, quotas): a call one of them
// refused with a retryable code is re-driven too. The handler must not
// depend on the header or the peer: it learns its user, the one
// Options.User named for the call, from idem.LeaseFromContext(ctx) (the
// lease's User), in a call and in a re-drive alike.
//
// # Client
//
// A Connect client puts the key in the request header itself
// (req.Header().Set(idemconnect.KeyHeader, key)), one key per operation
// kept across its retries; client.NewKey makes one.
package idemconnect
