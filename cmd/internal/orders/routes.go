package orders

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/problem"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// refundUnwritable answers for an order that the database refuses for
// good after its payment succeeded: it refunds the payment in full with the
// operation's refund key and answers the final 422 ProblemOrderNotWritable,
// which the middleware stores (see StoredStatus). If the refund fails it
// answers 502, not stored, so that the client's retry and the completer run
// the operation again: the same payment key replays the payment and the
// same refund key refunds it once.
func (s *server) refundUnwritable(ctx context.Context, w http.ResponseWriter, o *Order, refundKey string, cause error) {
	s.metrics.OrdersUnwritable.Add(1)
	s.cfg.Logger.ErrorContext(ctx, "orders: the database refuses the order; refunding its payment",
		"user", o.UserID, "order", o.ID, "payment", o.PaymentID, "err", cause)
	// The request's transaction is open (Create wrote in a savepoint of
	// it) and stays idle while the gateway refunds: keep it for as long as
	// the refund may take, or the database would end it once the lease's
	// worth of idleness passed, and an attempt whose refund is slower than
	// the lease would never store its answer.
	if k, ok := s.cfg.Repo.(TxKeeper); ok {
		d := s.cfg.PaymentTimeout
		if dl, ok := ctx.Deadline(); ok {
			d = time.Until(dl)
		}
		if err := k.KeepTx(ctx, d+time.Second); err != nil {
			s.cfg.Logger.ErrorContext(ctx, "orders: keeping the transaction open for the refund", "user", o.UserID, "order", o.ID, "err", err)
		}
	}
	if err := s.cfg.Payer.Refund(ctx, RefundRequest{PaymentID: o.PaymentID, IdempotencyKey: refundKey}); err != nil {
		s.metrics.RefundErrors.Add(1)
		s.cfg.Logger.ErrorContext(ctx, "orders: refund failed", "user", o.UserID, "order", o.ID, "payment", o.PaymentID, "err", err)
		writeProblem(w, newProblem(ProblemPaymentGateway, http.StatusBadGateway, "Payment gateway error",
			"The order could not be written and the refund of its payment failed. Nothing was stored; retry with the same Idempotency-Key, which never charges or refunds twice."))
		return
	}
	s.metrics.PaymentsRefunded.Add(1)
	p := newProblem(ProblemOrderNotWritable, http.StatusUnprocessableEntity, "Order could not be written",
		"The database refused the order for good, so no order was created and its payment "+o.PaymentID+
			" was refunded in full. This answer is final for this Idempotency-Key; use a new key to try again.")
	p.Extra = map[string]any{"payment_id": o.PaymentID}
	writeProblem(w, p)
}

func requestProblem(err error) problem.Details {
	if errors.Is(err, errBodyTooLarge) {
		return newProblem(problem.RequestTooLarge, http.StatusRequestEntityTooLarge, "Request body too large",
			"The request body is over "+strconv.Itoa(MaxBody)+" bytes.")
	}
	p := newProblem(ProblemInvalidRequest, http.StatusBadRequest, "Invalid request", err.Error())
	var ve *ValidationError
	if errors.As(err, &ve) {
		p.Extra = map[string]any{"errors": ve.Fields}
	}
	return p
}

func (s *server) getOrder(w http.ResponseWriter, r *http.Request) {
	user, _ := UserFromContext(r.Context())
	id := strings.TrimPrefix(r.URL.Path, "/v1/orders/")
	o, err := (*Order)(nil), ErrNotFound
	if lookupID(id) { // any other id names no order, and is not sent to the database
		o, err = s.cfg.Repo.Get(r.Context(), user, id)
	}
	switch {
	case err == nil:
		writeJSON(w, http.StatusOK, o)
	case errors.Is(err, ErrNotFound):
		writeProblem(w, newProblem(ProblemNotFound, http.StatusNotFound, "Not found", "You have no order "+id+"."))
	default:
		s.unavailable(w, r, err)
	}
}

// ListResponse is the body of GET /v1/orders.
type ListResponse struct {
	Orders  []Order `json:"orders"`
	HasMore bool    `json:"has_more"`
}

func (s *server) listOrders(w http.ResponseWriter, r *http.Request) {
	user, _ := UserFromContext(r.Context())
	q := r.URL.Query()
	limit := DefaultListLimit
	if q.Has("limit") {
		n, err := strconv.Atoi(q.Get("limit"))
		if err != nil || n < 1 || n > MaxListLimit {
			writeProblem(w, newProblem(ProblemInvalidRequest, http.StatusBadRequest, "Invalid request",
				"limit must be an integer from 1 to "+strconv.Itoa(MaxListLimit)+", not "+strconv.Quote(q.Get("limit"))+"."))
			return
		}
		limit = n
	}
	after := q.Get("starting_after")
	if q.Has("starting_after") && !lookupID(after) {
		writeProblem(w, newProblem(ProblemInvalidRequest, http.StatusBadRequest, "Invalid request", "starting_after must be an order id."))
		return
	}
	list, more, err := s.cfg.Repo.List(r.Context(), user, limit, after)
	switch {
	case err == nil:
	case errors.Is(err, ErrNotFound):
		writeProblem(w, newProblem(ProblemInvalidRequest, http.StatusBadRequest, "Invalid request",
			"starting_after: you have no order "+after+"."))
		return
	default:
		s.unavailable(w, r, err)
		return
	}
	if list == nil {
		list = []Order{}
	}
	writeJSON(w, http.StatusOK, ListResponse{Orders: list, HasMore: more})
}

func (s *server) health(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	w.Header().Set("Cache-Control", "no-store")
	if err := s.cfg.Health(ctx); err != nil {
		s.cfg.Logger.WarnContext(ctx, "orders: health check failed", "err", err)
		w.Header().Set("Retry-After", "1")
		writeProblem(w, newProblem(ProblemUnavailable, http.StatusServiceUnavailable, "Service unavailable", "The database does not answer."))
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

func (s *server) writeMetrics(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Cache-Control", "no-store")
	s.prom.ServeHTTP(w, r)
}

// endServerSpan ends the server span of a request to route, answered
// with code: named by the route, with the method (_OTHER for a method
// the API does not know), the route's path template and the status.
func endServerSpan(span trace.Span, method, route string, code int, panicked bool) {
	if !span.IsRecording() {
		span.End()
		return
	}
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodOptions, http.MethodConnect, http.MethodTrace:
	default:
		method = "_OTHER"
	}
	name := method
	if route != routeOther {
		name = route
	}
	span.SetName(name)
	attrs := []attribute.KeyValue{
		attribute.String("http.request.method", method),
		attribute.String("orders.route", route),
		attribute.Int("http.response.status_code", code),
	}
	if _, path, ok := strings.Cut(route, " "); ok && strings.HasPrefix(path, "/") {
		attrs = append(attrs, attribute.String("http.route", path))
	}
	span.SetAttributes(attrs...)
	switch {
	case panicked:
		span.SetStatus(codes.Error, "handler panicked")
	case code >= 500:
		span.SetStatus(codes.Error, http.StatusText(code))
	}
	span.End()
}

func (s *server) unavailable(w http.ResponseWriter, r *http.Request, err error) {
	s.cfg.Logger.ErrorContext(r.Context(), "orders: database", "path", r.URL.Path, "err", err)
	w.Header().Set("Retry-After", "1")
	writeProblem(w, newProblem(ProblemUnavailable, http.StatusServiceUnavailable, "Service unavailable", "The database did not answer; retry later."))
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := marshalJSON(v)
	if err != nil {
		writeProblem(w, idem.ProblemFor(err))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	w.Write(b)
}
