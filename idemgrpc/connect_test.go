package idemgrpc_test

// The Connect interceptor's tests (idemconnect), here beside the gRPC
// ones to share their service, stores and harness, and to call one store
// through both interceptors.

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemgrpc"
	"github.com/idem-go/idem/idemgrpc/idemconnect"
	"github.com/idem-go/idem/memstore"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
)

// connectOptions are testOptions for Connect: Create opted in, the user
// from the request's X-User header ("alice" without one).
func connectOptions() idemconnect.Options {
	return idemconnect.Options{
		Methods: map[string]idemconnect.Method{createMethod: idemconnect.Response[structpb.Struct]()},
		User: func(_ context.Context, req connect.AnyRequest) (string, error) {
			if u := req.Header().Values("x-user"); len(u) == 1 {
				return u[0], nil
			}
			return "alice", nil
		},
	}
}

// connectServer is svc served by Connect handlers of Create and Peek
// with interceptors, over HTTP/1.1 and unencrypted HTTP/2, so that gRPC
// clients can call it too.
type connectServer struct {
	url    string // base URL
	addr   string // host:port
	client *http.Client
}

func serveConnect(t testing.TB, svc *service, interceptors ...connect.Interceptor) connectServer {
	t.Helper()
	handle := func(ctx context.Context, req *connect.Request[structpb.Struct]) (*connect.Response[structpb.Struct], error) {
		resp, err := svc.call(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(resp), nil
	}
	mux := http.NewServeMux()
	for _, m := range []string{createMethod, peekMethod} {
		mux.Handle(m, connect.NewUnaryHandler(m, handle, connect.WithInterceptors(interceptors...)))
	}
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		srv.Close()
	})
	return connectServer{url: srv.URL, addr: srv.Listener.Addr().String(), client: &http.Client{Transport: tr}}
}

// creator returns a Connect client of the server's method, with opts
// (connect.WithGRPC() for the gRPC protocol).
func (s connectServer) creator(method string, opts ...connect.ClientOption) *connect.Client[structpb.Struct, structpb.Struct] {
	return connect.NewClient[structpb.Struct, structpb.Struct](s.client, s.url+method, opts...)
}

// grpcConn is a grpc-go client connection to the Connect server.
func (s connectServer) grpcConn(t testing.TB) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+s.addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("grpc.NewClient: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// answer is what one call of Create got, through either protocol.
type answer struct {
	resp       *structpb.Struct
	err        error
	code       codes.Code
	status     *spb.Status // err's, nil without one
	info       *errdetails.ErrorInfo
	replayed   bool   // idempotent-replayed: true
	retryAfter string // the retry-after trailer (gRPC) or error metadata (Connect)
}

// grpcAnswer is r as an answer.
func grpcAnswer(r result) answer {
	a := answer{resp: r.resp, err: r.err, code: status.Code(r.err), info: errorInfo(r.err), replayed: r.replayed()}
	if r.err != nil {
		a.status = status.Convert(r.err).Proto()
	}
	if ra := r.trailer.Get(idemgrpc.RetryAfterMetadata); len(ra) == 1 {
		a.retryAfter = ra[0]
	}
	return a
}

// call calls c with key (none if "") and req, header (name, value, …)
// added.
func call(ctx context.Context, c *connect.Client[structpb.Struct, structpb.Struct], key string, req *structpb.Struct, header ...string) answer {
	r := connect.NewRequest(req)
	if key != "" {
		r.Header().Set(idemconnect.KeyHeader, key)
	}
	for i := 0; i+1 < len(header); i += 2 {
		r.Header().Add(header[i], header[i+1])
	}
	resp, err := c.CallUnary(ctx, r)
	if err == nil {
		return answer{resp: resp.Msg, replayed: resp.Header().Get(idemconnect.ReplayedHeader) == "true"}
	}
	a := answer{err: err, code: codes.Code(connect.CodeOf(err))}
	var ce *connect.Error
	if errors.As(err, &ce) {
		a.replayed = ce.Meta().Get(idemconnect.ReplayedHeader) == "true"
		a.retryAfter = ce.Meta().Get(idemconnect.RetryAfterHeader)
		a.status = &spb.Status{Code: int32(ce.Code()), Message: ce.Message()}
		for _, d := range ce.Details() {
			a.status.Details = append(a.status.Details, &anypb.Any{TypeUrl: "type.googleapis.com/" + d.Type(), Value: d.Bytes()})
			if v, derr := d.Value(); derr == nil {
				if e, ok := v.(*errdetails.ErrorInfo); ok {
					a.info = e
				}
			}
		}
	}
	return a
}

// A transport serves the test service through one of the interceptors.
type transport struct {
	name string
	// start serves svc behind the interceptor on store, with
	// InFlightWait wait and otherwise testOptions (connectOptions), and
	// returns a function that calls Create.
	start func(t testing.TB, svc *service, store idem.Store, wait time.Duration) func(ctx context.Context, key string, req *structpb.Struct) answer
	// fail is a handler's error of code, msg and an ErrorInfo detail of
	// reason (none if "").
	fail func(t testing.TB, code codes.Code, msg, reason string) error
}

var transports = []transport{
	{
		name: "grpc",
		start: func(t testing.TB, svc *service, store idem.Store, wait time.Duration) func(context.Context, string, *structpb.Struct) answer {
			opts := testOptions()
			opts.InFlightWait = wait
			conn := serve(t, svc, []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(store, opts)})
			return func(ctx context.Context, key string, req *structpb.Struct) answer {
				return grpcAnswer(create(ctx, conn, key, req))
			}
		},
		fail: func(t testing.TB, code codes.Code, msg, reason string) error {
			st := status.New(code, msg)
			if reason != "" {
				var err error
				if st, err = st.WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: "payments.example"}); err != nil {
					t.Fatal(err)
				}
			}
			return st.Err()
		},
	},
	{
		name: "connect",
		start: func(t testing.TB, svc *service, store idem.Store, wait time.Duration) func(context.Context, string, *structpb.Struct) answer {
			opts := connectOptions()
			opts.InFlightWait = wait
			c := serveConnect(t, svc, idemconnect.NewInterceptor(store, opts)).creator(createMethod)
			return func(ctx context.Context, key string, req *structpb.Struct) answer { return call(ctx, c, key, req) }
		},
		fail: func(t testing.TB, code codes.Code, msg, reason string) error {
			e := connect.NewError(connect.Code(code), errors.New(msg))
			if reason != "" {
				d, err := connect.NewErrorDetail(&errdetails.ErrorInfo{Reason: reason, Domain: "payments.example"})
				if err != nil {
					t.Fatal(err)
				}
				e.AddDetail(d)
			}
			return e
		},
	},
}

// forEachTransport runs f, as a subtest, for each transport.
func forEachTransport(t *testing.T, f func(t *testing.T, tr transport)) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) { f(t, tr) })
	}
}

// forEachStoreAndTransport runs f, as a subtest, for each transport and
// store (forEachStore), each pair with a store of its own (the two
// interceptors share keys on one store).
func forEachStoreAndTransport(t *testing.T, f func(t *testing.T, h harness, tr transport)) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		forEachStore(t, func(t *testing.T, h harness) { f(t, h, tr) })
	})
}

// TestConnectKeyRules: a missing key, a bad one, two, a procedure not
// opted in, two users with one key, and User's errors.
func TestConnectKeyRules(t *testing.T) {
	svc := &service{handle: func(context.Context, *structpb.Struct) (*structpb.Struct, error) {
		return new(structpb.Struct), nil
	}}
	srv := serveConnect(t, svc, idemconnect.NewInterceptor(memstore.New(memstore.Options{}), connectOptions()))
	c, ctx := srv.creator(createMethod), t.Context()
	if r := call(ctx, c, "", order(t, "SKU-1")); r.code != codes.InvalidArgument || r.info.GetReason() != idemconnect.ReasonKeyMissing {
		t.Errorf("no key: %v, want InvalidArgument %s", r.err, idemconnect.ReasonKeyMissing)
	}
	for _, bad := range []string{"a b", strings.Repeat("k", 256), `"open`} {
		if r := call(ctx, c, bad, order(t, "SKU-1")); r.code != codes.InvalidArgument || r.info.GetReason() != idemconnect.ReasonKeyInvalid {
			t.Errorf("key %q: %v, want InvalidArgument %s", bad, r.err, idemconnect.ReasonKeyInvalid)
		}
	}
	if r := call(ctx, c, "k1", order(t, "SKU-1"), idemconnect.KeyHeader, "k2"); r.code != codes.InvalidArgument {
		t.Errorf("two keys: %v, want InvalidArgument", r.err)
	}
	if got := svc.runs.Load(); got != 0 {
		t.Fatalf("handler ran %d times on refused calls", got)
	}
	if r := call(ctx, c, "abc", order(t, "SKU-1")); r.err != nil || r.replayed {
		t.Fatalf("abc: %v", r.err)
	}
	if r := call(ctx, c, "abc", order(t, "SKU-1"), "x-user", "bob"); r.err != nil || r.replayed {
		t.Errorf("bob's abc: %v, replayed %v; want a run of its own", r.err, r.replayed)
	}
	peek := srv.creator(peekMethod)
	for range 2 {
		if r := call(ctx, peek, "peek", order(t, "SKU-1")); r.err != nil || r.replayed {
			t.Errorf("Peek: %v, replayed %v", r.err, r.replayed)
		}
	}
	if got := svc.runs.Load(); got != 4 {
		t.Errorf("handler ran %d times, want 4", got)
	}

	for _, u := range []struct {
		user func(context.Context, connect.AnyRequest) (string, error)
		want connect.Code
	}{
		{func(context.Context, connect.AnyRequest) (string, error) { return "", nil }, connect.CodeUnauthenticated},
		{func(context.Context, connect.AnyRequest) (string, error) { return "", errors.New("no token") }, connect.CodeUnauthenticated},
		{func(context.Context, connect.AnyRequest) (string, error) {
			return "", connect.NewError(connect.CodePermissionDenied, errors.New("no"))
		}, connect.CodePermissionDenied},
	} {
		opts := connectOptions()
		opts.User = u.user
		c := serveConnect(t, svc, idemconnect.NewInterceptor(memstore.New(memstore.Options{}), opts)).creator(createMethod)
		if r := call(ctx, c, "u", order(t, "SKU-1")); r.code != codes.Code(u.want) {
			t.Errorf("answer %v, want %v", r.err, u.want)
		}
	}
}

// TestConnectRefusesBadOptions: the constructor panics on options it
// cannot work with.
func TestConnectRefusesBadOptions(t *testing.T) {
	store := memstore.New(memstore.Options{})
	for name, c := range map[string]struct {
		store idem.Store
		opts  func(*idemconnect.Options)
	}{
		"nil store":  {nil, func(*idemconnect.Options) {}},
		"nil User":   {store, func(o *idemconnect.Options) { o.User = nil }},
		"no Methods": {store, func(o *idemconnect.Options) { o.Methods = nil }},
		"bad method": {store, func(o *idemconnect.Options) {
			o.Methods = map[string]idemconnect.Method{"Create": idemconnect.Response[structpb.Struct]()}
		}},
		"zero Method":  {store, func(o *idemconnect.Options) { o.Methods = map[string]idemconnect.Method{createMethod: {}} }},
		"lease >= TTL": {store, func(o *idemconnect.Options) { o.Lease, o.TTL = time.Hour, time.Minute }},
	} {
		t.Run(name, func(t *testing.T) {
			opts := connectOptions()
			c.opts(&opts)
			defer func() {
				if recover() == nil {
					t.Error("no panic")
				}
			}()
			idemconnect.NewInterceptor(c.store, opts)
		})
	}
}

// TestConnectAndGRPCShareKeys: one store behind a gRPC server (idemgrpc)
// and a Connect one (idemconnect) is one key space: a key first used
// through either replays through the other, byte for byte, answers and
// stored errors alike, and a grpc-go client of the Connect server gets
// the replay too.
func TestConnectAndGRPCShareKeys(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		var n atomic.Int64
		handle := func(ctx context.Context, req *structpb.Struct) (*structpb.Struct, error) {
			if err := h.write(ctx, "shared"); err != nil {
				return nil, err
			}
			return mustStruct(t, map[string]any{"order": float64(n.Add(1)), "sku": req.Fields["sku"].GetStringValue(), "m": map[string]any{"b": 1, "a": 2}}), nil
		}
		gsvc, csvc := &service{handle: handle}, &service{handle: handle}
		gconn := serve(t, gsvc, []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(h.store, testOptions())})
		csrv := serveConnect(t, csvc, idemconnect.NewInterceptor(h.store, connectOptions()))
		c, ctx := csrv.creator(createMethod), t.Context()

		// gRPC first, Connect replays, over the Connect protocol and over
		// gRPC (connect.WithGRPC).
		g := grpcAnswer(create(ctx, gconn, "from-grpc", order(t, "SKU-1")))
		if g.err != nil || g.replayed {
			t.Fatalf("gRPC: %v, replayed %v", g.err, g.replayed)
		}
		for _, c := range []*connect.Client[structpb.Struct, structpb.Struct]{c, csrv.creator(createMethod, connect.WithGRPC())} {
			r := call(ctx, c, "from-grpc", order(t, "SKU-1"))
			if r.err != nil || !r.replayed || !bytes.Equal(encode(t, r.resp), encode(t, g.resp)) {
				t.Errorf("Connect after gRPC: %v, replayed %v, %v want %v", r.err, r.replayed, r.resp, g.resp)
			}
		}
		// Connect first, gRPC replays, and so does a grpc-go client of
		// the Connect server.
		r := call(ctx, c, "from-connect", order(t, "SKU-2"))
		if r.err != nil || r.replayed {
			t.Fatalf("Connect: %v, replayed %v", r.err, r.replayed)
		}
		for name, conn := range map[string]*grpc.ClientConn{"gRPC server": gconn, "Connect server": csrv.grpcConn(t)} {
			g := grpcAnswer(create(ctx, conn, "from-connect", order(t, "SKU-2")))
			if g.err != nil || !g.replayed || !bytes.Equal(encode(t, g.resp), encode(t, r.resp)) {
				t.Errorf("gRPC client of the %s after Connect: %v, replayed %v, %v want %v", name, g.err, g.replayed, g.resp, r.resp)
			}
		}
		// Another request with a key of the other is refused.
		if r := call(ctx, c, "from-grpc", order(t, "SKU-2")); r.code != codes.InvalidArgument {
			t.Errorf("Connect, gRPC's key, another request: %v, want InvalidArgument", r.err)
		}
		if g := grpcAnswer(create(ctx, gconn, "from-connect", order(t, "SKU-1"))); g.code != codes.InvalidArgument {
			t.Errorf("gRPC, Connect's key, another request: %v, want InvalidArgument", g.err)
		}
		if runs := gsvc.runs.Load() + csvc.runs.Load(); runs != 2 {
			t.Errorf("handlers ran %d times, want 2", runs)
		}
		if got := h.count(t, "shared"); got != 2 {
			t.Errorf("the handlers' writes committed %d times, want 2", got)
		}

		// A stored error, both ways: code, message and details.
		gsvc.handle = func(context.Context, *structpb.Struct) (*structpb.Struct, error) {
			return nil, transports[0].fail(t, codes.FailedPrecondition, "card declined", "CARD_DECLINED")
		}
		csvc.handle = func(context.Context, *structpb.Struct) (*structpb.Struct, error) {
			return nil, transports[1].fail(t, codes.FailedPrecondition, "card declined", "CARD_DECLINED")
		}
		g = grpcAnswer(create(ctx, gconn, "declined-grpc", order(t, "SKU-1")))
		r = call(ctx, c, "declined-grpc", order(t, "SKU-1"))
		if g.code != codes.FailedPrecondition || !r.replayed || !proto.Equal(r.status, g.status) {
			t.Errorf("Connect after gRPC's error %v: %v, replayed %v", g.status, r.status, r.replayed)
		}
		r = call(ctx, c, "declined-connect", order(t, "SKU-1"))
		g = grpcAnswer(create(ctx, gconn, "declined-connect", order(t, "SKU-1")))
		if r.code != codes.FailedPrecondition || !g.replayed || !proto.Equal(r.status, g.status) {
			t.Errorf("gRPC after Connect's error %v: %v, replayed %v", r.status, g.status, g.replayed)
		}
		if runs := gsvc.runs.Load() + csvc.runs.Load(); runs != 4 {
			t.Errorf("handlers ran %d times, want 4", runs)
		}
	})
}
