package orders

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"github.com/idem-go/idem/cmd/internal/api/ordersv1"
	"github.com/idem-go/idem/cmd/internal/api/ordersv1/ordersv1connect"
	"github.com/idem-go/idem/idemgrpc"
	"github.com/idem-go/idem/idemgrpc/idemconnect"
	"github.com/idem-go/idem/problem"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// routeCreateRPC is the path of the order service's one RPC,
// orders.v1.OrderService/CreateOrder (cmd/internal/api/proto), served
// beside the HTTP API on the same address over Connect, gRPC and
// gRPC-Web; also its metrics and trace route. Any other path under the
// service is the API's 404.
const routeCreateRPC = ordersv1connect.OrderServiceCreateOrderProcedure

// rpcService implements orders.v1.OrderService by sending each call,
// turned into POST /v1/orders, through the HTTP API's own chain
// (authentication, the user's rate limit, the guest gate, the
// idempotency middleware, createOrder) and turning its answer back.
//
// One chain makes one key space. The call's fingerprint is the HTTP
// request's (POST, /v1/orders and the canonical JSON of the body), and
// its stored answer is the HTTP answer, so a key first used over HTTP
// replays over gRPC or Connect and the reverse, and the completer, the
// cleaner, the payment's derived key and the orders' audit treat a call
// as they treat a request. Two key spaces would let one key make two
// orders, and charge twice, for a client that retries over the other
// transport.
type rpcService struct {
	create http.Handler // s.create
}

// newRPCHandler returns the Connect handler of orders.v1.OrderService,
// which serves routeCreateRPC.
func newRPCHandler(create http.Handler) http.Handler {
	_, h := ordersv1connect.NewOrderServiceHandler(rpcService{create: create},
		// A CreateOrderRequest's JSON is larger than its protobuf
		// encoding: a message over MaxBody could only become a body
		// over it.
		connect.WithReadMaxBytes(MaxBody))
	// Aborted (a key in flight) as a Trailers-Only answer, which gRPC
	// clients' retry policies retry.
	return idemconnect.TrailersOnly(h)
}

// CreateOrder is POST /v1/orders over RPC: the headers authorization
// and idempotency-key (gRPC metadata entries are headers) are the HTTP
// request's, the message its JSON body.
func (s rpcService) CreateOrder(ctx context.Context, req *connect.Request[ordersv1.CreateOrderRequest]) (*connect.Response[ordersv1.Order], error) {
	body, err := json.Marshal(createRequestOf(req.Msg))
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("encoding the order: %w", err))
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, "/v1/orders", bytes.NewReader(body))
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	for _, name := range []string{"Authorization", "Idempotency-Key"} {
		if vs := req.Header().Values(name); len(vs) > 0 {
			hr.Header[name] = vs
		}
	}
	hr.Header.Set("Content-Type", "application/json")
	hr.RemoteAddr = req.Peer().Addr

	var w answerRecorder
	s.create.ServeHTTP(&w, hr)
	if p, ok := ctx.Value(innerStatusKey{}).(*int); ok {
		*p = w.status
	}
	return rpcAnswer(&w)
}

// innerStatusKey is the context key under which ServeHTTP gives
// CreateOrder an int to set to its create's HTTP status: the code of
// orders_http_responses_total for the RPC's route, so that a declined or
// refused call counts as over HTTP (the RPC exchange itself is a 200).
type innerStatusKey struct{}

// isRPCMediaType reports whether the Content-Type value v names a media
// type of a protocol CreateOrder is served in: Connect's (application/proto,
// application/json), gRPC's and gRPC-Web's (application/grpc…), in any
// case, with or without parameters. Connect refuses the others with 415.
func isRPCMediaType(v string) bool {
	mt := bareMediaType(v)
	return mt == "application/proto" || mt == "application/json" || strings.HasPrefix(mt, "application/grpc")
}

// createRequestOf is the body of POST /v1/orders that m stands for: every
// member present, as the HTTP API's documented example writes them, so
// that the same order sent over HTTP has the same fingerprint.
func createRequestOf(m *ordersv1.CreateOrderRequest) CreateRequest {
	items := make([]Item, 0, len(m.GetItems()))
	for _, it := range m.GetItems() {
		items = append(items, Item{SKU: it.GetSku(), Quantity: it.GetQuantity(), UnitPrice: it.GetUnitPrice()})
	}
	return CreateRequest{Items: items, Currency: m.GetCurrency()}
}

// rpcAnswer turns the HTTP chain's answer w into the call's: a 201 order
// into the Order message, a problem into an error (rpcError), with the
// replay marked in the idempotent-replayed header as over gRPC
// (idemgrpc.ReplayedMetadata).
func rpcAnswer(w *answerRecorder) (*connect.Response[ordersv1.Order], error) {
	replayed := w.header.Get("Idempotent-Replayed") == "true"
	mediaType, _, _ := mime.ParseMediaType(w.header.Get("Content-Type"))
	if w.status == http.StatusCreated && mediaType == "application/json" {
		var o Order
		if err := json.Unmarshal(w.body.Bytes(), &o); err != nil {
			return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("reading the created order: %w", err))
		}
		resp := connect.NewResponse(orderMessage(&o))
		if replayed {
			resp.Header().Set(idemgrpc.ReplayedMetadata, "true")
		}
		return resp, nil
	}
	cerr := rpcError(w.status, w.body.Bytes())
	if replayed {
		cerr.Meta().Set(idemgrpc.ReplayedMetadata, "true")
	}
	if ra := w.header.Get("Retry-After"); ra != "" {
		cerr.Meta().Set(idemgrpc.RetryAfterMetadata, ra)
	}
	return nil, cerr
}

// orderMessage is o as an orders.v1.Order.
func orderMessage(o *Order) *ordersv1.Order {
	items := make([]*ordersv1.Item, len(o.Items))
	for i, it := range o.Items {
		items[i] = &ordersv1.Item{Sku: it.SKU, Quantity: it.Quantity, UnitPrice: it.UnitPrice}
	}
	return &ordersv1.Order{
		Id: o.ID, UserId: o.UserID, Status: o.Status, Items: items, Total: o.Total,
		Currency: o.Currency, PaymentId: o.PaymentID, CreatedAt: timestamppb.New(o.CreatedAt),
	}
}

// rpcError is the error of an HTTP answer of status that is not an
// order: its problem's detail (or title) as the message, a code from
// rpcCode, and a google.rpc.ErrorInfo (domain idemgrpc.ErrorDomain)
// naming the problem: reason the problem type's last segment in upper
// snake case (the idempotency key's problems take idemgrpc's reasons),
// metadata its type, status and payment_id. A validation problem also
// carries a google.rpc.BadRequest with a violation per field.
func rpcError(status int, body []byte) *connect.Error {
	var p struct {
		problem.Details
		PaymentID      string       `json:"payment_id"`
		OriginalStatus int          `json:"original_status"`
		Errors         []FieldError `json:"errors"`
	}
	if err := json.Unmarshal(body, &p); err != nil || p.Type == "" {
		// Not a problem: never written by the chain, but kept readable.
		return connect.NewError(rpcCode(status, ""), fmt.Errorf("HTTP %d: %s", status, truncate(string(body), 200)))
	}
	msg := p.Detail
	if msg == "" {
		msg = p.Title
	}
	cerr := connect.NewError(rpcCode(status, p.Type), errors.New(msg))
	info := &errdetails.ErrorInfo{
		Reason:   rpcReason(p.Type),
		Domain:   idemgrpc.ErrorDomain,
		Metadata: map[string]string{"type": p.Type, "status": strconv.Itoa(status)},
	}
	if p.PaymentID != "" {
		info.Metadata["payment_id"] = p.PaymentID
	}
	if p.OriginalStatus != 0 {
		info.Metadata["original_status"] = strconv.Itoa(p.OriginalStatus)
	}
	addDetail(cerr, info)
	if len(p.Errors) > 0 {
		br := new(errdetails.BadRequest)
		for _, f := range p.Errors {
			br.FieldViolations = append(br.FieldViolations, &errdetails.BadRequest_FieldViolation{Field: fieldPath(f.Pointer), Description: f.Detail})
		}
		addDetail(cerr, br)
	}
	return cerr
}

// addDetail adds msg to cerr's details in deterministic encoding, so
// that a replayed error is the same bytes every time (connect's own
// encoding of ErrorInfo's metadata map follows Go's map order).
func addDetail(cerr *connect.Error, msg proto.Message) {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(msg)
	if err != nil {
		return
	}
	d, err := connect.NewErrorDetail(&anypb.Any{TypeUrl: "type.googleapis.com/" + string(msg.ProtoReflect().Descriptor().FullName()), Value: b})
	if err == nil {
		cerr.AddDetail(d)
	}
}

// rpcCode is the code of an HTTP answer of status and problem type typ:
//
//	400, 413 (and a 422 idempotency-key-mismatch)  InvalidArgument
//	401                                            Unauthenticated
//	402 (payment declined), 422 (order not written) FailedPrecondition
//	403 (guest order limit)                        PermissionDenied
//	409 (key in flight, order conflict)            Aborted
//	429                                            ResourceExhausted
//	502, 503, 504                                  Unavailable
//	500 and any other                              Internal (a 4xx: Unknown)
func rpcCode(status int, typ string) connect.Code {
	switch status {
	case http.StatusBadRequest, http.StatusRequestEntityTooLarge, http.StatusUnsupportedMediaType:
		return connect.CodeInvalidArgument
	case http.StatusUnauthorized:
		return connect.CodeUnauthenticated
	case http.StatusPaymentRequired:
		return connect.CodeFailedPrecondition
	case http.StatusForbidden:
		return connect.CodePermissionDenied
	case http.StatusConflict:
		return connect.CodeAborted
	case http.StatusUnprocessableEntity:
		if typ == problem.KeyMismatch {
			return connect.CodeInvalidArgument
		}
		return connect.CodeFailedPrecondition
	case http.StatusTooManyRequests:
		return connect.CodeResourceExhausted
	case http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return connect.CodeUnavailable
	}
	if status >= 400 && status < 500 {
		return connect.CodeUnknown
	}
	return connect.CodeInternal
}

// rpcReason is the ErrorInfo reason of problem type typ.
func rpcReason(typ string) string {
	switch typ {
	case problem.KeyMismatch:
		return idemgrpc.ReasonKeyReused
	case problem.KeyMissing:
		return idemgrpc.ReasonKeyMissing
	case problem.KeyInvalid:
		return idemgrpc.ReasonKeyInvalid
	}
	name := typ[strings.LastIndexByte(typ, '/')+1:]
	return strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// fieldPath turns a JSON Pointer into a request body ("/items/0/sku")
// into the message's field path as google.rpc.BadRequest spells it
// ("items[0].sku").
func fieldPath(pointer string) string {
	var b strings.Builder
	for i, seg := range strings.Split(strings.TrimPrefix(pointer, "/"), "/") {
		seg = strings.ReplaceAll(strings.ReplaceAll(seg, "~1", "/"), "~0", "~")
		if _, err := strconv.Atoi(seg); err == nil && i > 0 {
			b.WriteString("[" + seg + "]")
			continue
		}
		if i > 0 {
			b.WriteByte('.')
		}
		b.WriteString(seg)
	}
	return b.String()
}

// truncate returns s cut to at most n bytes.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// answerRecorder is the http.ResponseWriter the HTTP chain answers a call
// into.
type answerRecorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (w *answerRecorder) Header() http.Header {
	if w.header == nil {
		w.header = make(http.Header)
	}
	return w.header
}

func (w *answerRecorder) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
}

func (w *answerRecorder) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.body.Write(p)
}
