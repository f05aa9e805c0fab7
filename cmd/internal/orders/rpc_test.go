package orders

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/idem-go/idem/cmd/internal/api/ordersv1"
	"github.com/idem-go/idem/cmd/internal/api/ordersv1/ordersv1connect"
	"github.com/idem-go/idem/idemgrpc"
	"github.com/idem-go/idem/problem"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// rpcResult is one CreateOrder call's answer, whatever the client.
type rpcResult struct {
	order  *ordersv1.Order // OK
	code   connect.Code    // 0: OK
	msg    string
	reason string            // the error's ErrorInfo reason
	info   map[string]string // and metadata
	fields []string          // the error's BadRequest field paths
	raw    []string          // the error's details as sent (their Any values)
	meta   http.Header       // response headers and trailers (error metadata)
}

func (r rpcResult) replayed() bool { return r.meta.Get(idemgrpc.ReplayedMetadata) == "true" }

func (r rpcResult) String() string {
	if r.code == 0 {
		return fmt.Sprintf("OK %v", r.order)
	}
	return fmt.Sprintf("%v %q reason %s %v fields %v", r.code, r.msg, r.reason, r.info, r.fields)
}

// rpcClient calls CreateOrder over one transport; key "" sends none.
type rpcClient struct {
	name string
	call func(ctx context.Context, token, key string, req *ordersv1.CreateOrderRequest) rpcResult
}

// rpcClients returns a client of b's server for each transport: grpc-go,
// and connect-go's Connect, gRPC and gRPC-Web protocols. extra are more
// grpc-go dial options (a retry policy).
func rpcClients(t testing.TB, b *testBundle, extra ...grpc.DialOption) []rpcClient {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+strings.TrimPrefix(b.srv.URL, "http://"),
		append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, extra...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	h2c := &http.Transport{Protocols: new(http.Protocols)}
	h2c.Protocols.SetUnencryptedHTTP2(true)
	t.Cleanup(h2c.CloseIdleConnections)
	viaConnect := func(name string, hc *http.Client, opts ...connect.ClientOption) rpcClient {
		c := ordersv1connect.NewOrderServiceClient(hc, b.srv.URL, opts...)
		return rpcClient{name: name, call: func(ctx context.Context, token, key string, m *ordersv1.CreateOrderRequest) rpcResult {
			req := connect.NewRequest(m)
			req.Header().Set("Authorization", "Bearer "+token)
			if key != "" {
				req.Header().Set(idemgrpc.KeyMetadata, key)
			}
			resp, err := c.CreateOrder(ctx, req)
			if err != nil {
				return connectResult(t, err)
			}
			meta := resp.Header().Clone()
			for k, v := range resp.Trailer() {
				meta[k] = append(meta[k], v...)
			}
			return rpcResult{order: resp.Msg, meta: meta}
		}}
	}
	return []rpcClient{
		{name: "grpc-go", call: func(ctx context.Context, token, key string, m *ordersv1.CreateOrderRequest) rpcResult {
			ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
			if key != "" {
				ctx = metadata.AppendToOutgoingContext(ctx, idemgrpc.KeyMetadata, key)
			}
			var header, trailer metadata.MD
			out := new(ordersv1.Order)
			err := conn.Invoke(ctx, ordersv1connect.OrderServiceCreateOrderProcedure, m, out, grpc.Header(&header), grpc.Trailer(&trailer))
			meta := make(http.Header)
			for _, md := range []metadata.MD{header, trailer} {
				for k, vs := range md {
					for _, v := range vs {
						meta.Add(k, v)
					}
				}
			}
			if err != nil {
				r := grpcResult(t, err)
				r.meta = meta
				return r
			}
			return rpcResult{order: out, meta: meta}
		}},
		viaConnect("connect", http.DefaultClient),
		viaConnect("connect-grpc", &http.Client{Transport: h2c}, connect.WithGRPC()),
		viaConnect("grpc-web", http.DefaultClient, connect.WithGRPCWeb()),
	}
}

// grpcResult reads a grpc-go error.
func grpcResult(t testing.TB, err error) rpcResult {
	t.Helper()
	st, ok := status.FromError(err)
	if !ok {
		t.Fatalf("not a gRPC status: %v", err)
	}
	r := rpcResult{code: connect.Code(st.Code()), msg: st.Message()}
	for _, d := range st.Details() {
		r.addDetail(d)
	}
	for _, d := range st.Proto().GetDetails() {
		r.raw = append(r.raw, string(d.GetValue()))
	}
	return r
}

// connectResult reads a connect-go error.
func connectResult(t testing.TB, err error) rpcResult {
	t.Helper()
	var cerr *connect.Error
	if !errors.As(err, &cerr) {
		t.Fatalf("not a connect error: %v", err)
	}
	r := rpcResult{code: cerr.Code(), msg: cerr.Message(), meta: cerr.Meta()}
	for _, d := range cerr.Details() {
		v, derr := d.Value()
		if derr != nil {
			t.Fatalf("error detail %s: %v", d.Type(), derr)
		}
		r.addDetail(v)
		r.raw = append(r.raw, string(d.Bytes()))
	}
	return r
}

func (r *rpcResult) addDetail(d any) {
	switch d := d.(type) {
	case *errdetails.ErrorInfo:
		if d.GetDomain() == idemgrpc.ErrorDomain {
			r.reason, r.info = d.GetReason(), d.GetMetadata()
		}
	case *errdetails.BadRequest:
		for _, f := range d.GetFieldViolations() {
			r.fields = append(r.fields, f.GetField())
		}
	}
}

// orderRequest is orderBody's order as a message.
func orderRequest() *ordersv1.CreateOrderRequest {
	return &ordersv1.CreateOrderRequest{
		Items:    []*ordersv1.Item{{Sku: "SKU-1", Quantity: 2, UnitPrice: 1299}},
		Currency: "EUR",
	}
}

// A key first used over any transport replays over every other one, and
// over HTTP, and the reverse: one order, one payment per key, the same
// message every time (the same bytes in deterministic encoding).
func TestRPCSharesKeysWithHTTP(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	tok := b.token(t, "alice")
	clients := rpcClients(t, b)

	// check that got is the replay of the order whose id is want.
	check := func(t *testing.T, via string, got rpcResult, want *ordersv1.Order) {
		t.Helper()
		if got.code != 0 {
			t.Fatalf("%s: %s, want the order", via, got)
		}
		if !got.replayed() {
			t.Errorf("%s: %s not marked %s: %v", via, got.order.GetId(), idemgrpc.ReplayedMetadata, got.meta)
		}
		a, _ := proto.MarshalOptions{Deterministic: true}.Marshal(got.order)
		w, _ := proto.MarshalOptions{Deterministic: true}.Marshal(want)
		if string(a) != string(w) {
			t.Errorf("%s: replayed %v, want %v", via, got.order, want)
		}
	}

	keys := 0
	for _, first := range clients {
		key := "rpc-first-" + first.name
		keys++
		got := first.call(ctx, tok, key, orderRequest())
		if got.code != 0 {
			t.Fatalf("%s: %s", first.name, got)
		}
		o := got.order
		if got.replayed() {
			t.Errorf("%s: the first answer is marked replayed", first.name)
		}
		if !strings.HasPrefix(o.GetId(), "ord_") || o.GetUserId() != "alice" || o.GetStatus() != StatusPaid ||
			o.GetTotal() != 2598 || o.GetCurrency() != "EUR" || o.GetPaymentId() == "" || len(o.GetItems()) != 1 ||
			!proto.Equal(o.GetItems()[0], orderRequest().GetItems()[0]) || !o.GetCreatedAt().AsTime().Equal(b.clock.Now()) {
			t.Errorf("%s: order %v", first.name, o)
		}
		for _, again := range clients {
			check(t, first.name+" then "+again.name, again.call(ctx, tok, key, orderRequest()), o)
		}
		h := b.post(t, "alice", key, orderBody)
		if h.status != http.StatusCreated || h.header.Get("Idempotent-Replayed") != "true" || decodeOrder(t, h.body).ID != o.GetId() {
			t.Errorf("%s then HTTP: %s, want the replay of %s", first.name, h, o.GetId())
		}
	}

	// HTTP first, then every transport.
	keys++
	h := b.post(t, "alice", "http-first", orderBody)
	if h.status != http.StatusCreated {
		t.Fatalf("HTTP: %s", h)
	}
	want := orderMessage(new(decodeOrder(t, h.body)))
	for _, c := range clients {
		check(t, "HTTP then "+c.name, c.call(ctx, tok, "http-first", orderRequest()), want)
	}

	if got := b.payer.callCount(); got != keys {
		t.Errorf("gateway calls = %d, want %d (one per key)", got, keys)
	}
	if got := b.countOrders(t); got != keys {
		t.Errorf("orders = %d, want %d", got, keys)
	}
}

// The answers a call can get besides an order, over every transport:
// each a code and an ErrorInfo naming the HTTP API's problem; nothing is
// paid for a refused call.
func TestRPCRefusals(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	tok := b.token(t, "alice")
	for _, c := range rpcClients(t, b) {
		t.Run(c.name, func(t *testing.T) {
			calls := b.payer.callCount()
			want := func(got rpcResult, code connect.Code, reason string) {
				t.Helper()
				if got.code != code || got.reason != reason || got.msg == "" {
					t.Errorf("%s, want %v with reason %s and a message", got, code, reason)
				}
			}
			want(c.call(ctx, tok, "", orderRequest()), connect.CodeInvalidArgument, idemgrpc.ReasonKeyMissing)
			want(c.call(ctx, tok, strings.Repeat("k", 256), orderRequest()), connect.CodeInvalidArgument, idemgrpc.ReasonKeyInvalid)
			want(c.call(ctx, "not-a-token", "r-1", orderRequest()), connect.CodeUnauthenticated, "UNAUTHORIZED")

			bad := orderRequest()
			bad.Items[0].Quantity = 0
			bad.Currency = "XXY"
			got := c.call(ctx, tok, "r-bad-"+c.name, bad)
			want(got, connect.CodeInvalidArgument, "INVALID_REQUEST")
			if fmt.Sprint(got.fields) != "[items[0].quantity currency]" && fmt.Sprint(got.fields) != "[currency items[0].quantity]" {
				t.Errorf("field violations %q, want items[0].quantity and currency", got.fields)
			}
			// A refused body leaves the key free: the corrected order is made.
			if got := c.call(ctx, tok, "r-bad-"+c.name, orderRequest()); got.code != 0 || got.replayed() {
				t.Errorf("corrected order: %s", got)
			}
			// The same key with another order is refused, not paid.
			other := orderRequest()
			other.Items[0].Quantity = 3
			want(c.call(ctx, tok, "r-bad-"+c.name, other), connect.CodeInvalidArgument, idemgrpc.ReasonKeyReused)
			if got := b.payer.callCount() - calls; got != 1 {
				t.Errorf("gateway calls = %d, want 1 (the corrected order)", got)
			}
		})
	}

	// A declined payment is final for its key: stored and replayed, over
	// any transport and HTTP.
	b.payer.declineOver = 1000
	clients := rpcClients(t, b)
	first := clients[0].call(ctx, tok, "declined", orderRequest())
	if first.code != connect.CodeFailedPrecondition || first.reason != "PAYMENT_DECLINED" || first.replayed() {
		t.Fatalf("declined: %s", first)
	}
	for _, c := range clients {
		for range 5 {
			got := c.call(ctx, tok, "declined", orderRequest())
			if got.code != connect.CodeFailedPrecondition || got.reason != "PAYMENT_DECLINED" || got.msg != first.msg || !got.replayed() {
				t.Errorf("%s: %s (replayed %v), want the replay of %s", c.name, got, got.replayed(), first)
			}
			// The same bytes every time, whatever the order Go gives the
			// ErrorInfo's metadata map.
			if fmt.Sprint(got.raw) != fmt.Sprint(first.raw) {
				t.Errorf("%s: replayed error details %x, first %x", c.name, got.raw, first.raw)
			}
		}
	}
	b.post(t, "alice", "declined", orderBody).wantProblem(t, http.StatusPaymentRequired, ProblemPaymentDeclined)
	if got := b.countOrders(t); got != len(clients) {
		t.Errorf("orders = %d, want %d (the corrected ones)", got, len(clients))
	}

	// The metrics count each call by its create's status, as over HTTP:
	// the declined call and its replays over every transport are 402s.
	m := b.do(t, req{method: "GET", path: "/metrics"})
	for code, want := range map[string]float64{"402": float64(1 + 5*len(clients)), "201": float64(len(clients))} {
		if v, ok := promSample(string(m.body), "orders_http_responses_total", map[string]string{"route": routeCreateRPC, "code": code}); !ok || v != want {
			t.Errorf("orders_http_responses_total{route=%q,code=%q} = %v (found %v), want %v", routeCreateRPC, code, v, ok, want)
		}
	}
}

// Fifty identical calls at once over gRPC make one order and one
// payment; the others are Aborted with retry-after, and grpc-go's retry
// policy retries them (the Aborted answer is Trailers-Only) until they
// get the order's replay.
func TestRPCConcurrentSameKey(t *testing.T) {
	const retryPolicy = `{"methodConfig": [{"name": [{"service": "orders.v1.OrderService"}],
		"retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
			"backoffMultiplier": 2, "retryableStatusCodes": ["ABORTED"]}}]}`
	for _, retry := range []bool{false, true} {
		t.Run(fmt.Sprintf("retry=%v", retry), func(t *testing.T) {
			b := setup(t)
			tok := b.token(t, "alice")
			var opts []grpc.DialOption
			if retry {
				opts = append(opts, grpc.WithDefaultServiceConfig(retryPolicy))
			}
			c := rpcClients(t, b, opts...)[0]
			const n = 50
			results := make([]rpcResult, n)
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := range n {
				wg.Go(func() {
					<-start
					ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
					defer cancel()
					results[i] = c.call(ctx, tok, "storm", orderRequest())
				})
			}
			close(start)
			wg.Wait()
			var id string
			counts := map[connect.Code]int{}
			for _, r := range results {
				counts[r.code]++
				switch r.code {
				case 0:
					if id == "" {
						id = r.order.GetId()
					} else if r.order.GetId() != id {
						t.Errorf("two orders: %s and %s", id, r.order.GetId())
					}
				case connect.CodeAborted:
					if retry {
						t.Errorf("Aborted although retried: %s", r)
					}
					if r.reason != "IDEMPOTENCY_KEY_IN_FLIGHT" || r.meta.Get(idemgrpc.RetryAfterMetadata) == "" {
						t.Errorf("Aborted without its reason or %s: %s %v", idemgrpc.RetryAfterMetadata, r, r.meta)
					}
				default:
					t.Errorf("unexpected answer %s", r)
				}
			}
			t.Logf("answers: %v", counts)
			if counts[0] == 0 {
				t.Error("no call created the order")
			}
			if got := b.countOrders(t); got != 1 {
				t.Errorf("orders = %d, want 1", got)
			}
			if got := b.payer.callCount(); got != 1 {
				t.Errorf("gateway calls = %d, want 1", got)
			}
			if got := b.idemM.Executions.Load(); got != 1 {
				t.Errorf("handler runs = %d, want 1", got)
			}
		})
	}
}

// A call with its key in flight: Aborted at once, with retry-after; the
// same key over HTTP is 409 meanwhile; once the first call ends, the
// repeat replays it.
func TestRPCInFlight(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	tok := b.token(t, "alice")
	c := rpcClients(t, b)[0]
	block := make(chan struct{})
	b.payer.block = block
	b.payer.entered = make(chan struct{}, 1)
	done := make(chan rpcResult, 1)
	go func() { done <- c.call(ctx, tok, "slow", orderRequest()) }()
	<-b.payer.entered

	got := c.call(ctx, tok, "slow", orderRequest())
	if got.code != connect.CodeAborted || got.reason != "IDEMPOTENCY_KEY_IN_FLIGHT" || got.meta.Get(idemgrpc.RetryAfterMetadata) == "" {
		t.Errorf("repeat in flight: %s %v, want Aborted with retry-after", got, got.meta)
	}
	b.post(t, "alice", "slow", orderBody).wantProblem(t, http.StatusConflict, problem.InFlight)
	close(block)
	first := <-done
	if first.code != 0 {
		t.Fatalf("first: %s", first)
	}
	if again := c.call(ctx, tok, "slow", orderRequest()); again.code != 0 || !again.replayed() || again.order.GetId() != first.order.GetId() {
		t.Errorf("after it: %s, want the replay of %s", again, first.order.GetId())
	}
}

func TestFieldPath(t *testing.T) {
	for in, want := range map[string]string{
		"/items":              "items",
		"/items/0/quantity":   "items[0].quantity",
		"/items/12/sku":       "items[12].sku",
		"/currency":           "currency",
		"":                    "",
		"/a~1b/0":             "a/b[0]",
		"/items/0/unit_price": "items[0].unit_price",
	} {
		if got := fieldPath(in); got != want {
			t.Errorf("fieldPath(%q) = %q, want %q", in, got, want)
		}
	}
}

// The RPC's path takes POST alone: any other method, any other path
// under the service, and a media type no RPC protocol speaks, is the
// API's problem, as for every route.
func TestRPCPathAnswersProblems(t *testing.T) {
	b := setup(t)
	got := b.do(t, req{method: "GET", path: "/orders.v1.OrderService/CreateOrder"})
	got.wantProblem(t, http.StatusMethodNotAllowed, ProblemMethodNotAllowed)
	if a := got.header.Get("Allow"); a != "POST" {
		t.Errorf("Allow = %q, want POST", a)
	}
	b.do(t, req{method: "POST", path: "/orders.v1.OrderService/DeleteOrder", body: "{}"}).
		wantProblem(t, http.StatusNotFound, ProblemNotFound)
	// A media type none of the RPC protocols speaks: the API's 415.
	got = b.do(t, req{method: "POST", path: "/orders.v1.OrderService/CreateOrder", body: "{}", header: map[string]string{"Content-Type": "text/plain"}})
	got.wantProblem(t, http.StatusUnsupportedMediaType, ProblemUnsupportedMediaType)
	if got.header.Get("Accept-Post") == "" {
		t.Error("415 without Accept-Post")
	}
}
