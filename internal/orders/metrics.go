package orders

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/idem-go/idem"
)

// Metrics counts what the order handler did. The zero value is ready; all
// fields are safe for concurrent use.
type Metrics struct {
	OrdersCreated    atomic.Int64 // orders written (committed or not: a fenced attempt rolls back)
	PaymentsMade     atomic.Int64 // Pay calls that succeeded (gateway replays included)
	PaymentsFound    atomic.Int64 // payments of an earlier attempt found by FindPayment, used instead of paying
	PaymentsDeclined atomic.Int64 // Pay calls declined
	GatewayErrors    atomic.Int64 // Pay calls that failed otherwise
	OrdersUnwritable atomic.Int64 // paid orders the database refused for good
	PaymentsRefunded atomic.Int64 // Refund calls that succeeded (gateway replays included)
	RefundErrors     atomic.Int64 // Refund calls that failed

	mu        sync.Mutex // guards responses
	responses map[responseLabel]int64
}

type responseLabel struct {
	route string
	code  int
}

func (m *Metrics) countResponse(route string, code int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.responses == nil {
		m.responses = make(map[responseLabel]int64)
	}
	m.responses[responseLabel{route, code}]++
}

// WritePrometheus writes m and idem's counters im (when not nil) in the
// Prometheus text exposition format, version 0.0.4.
func (m *Metrics) WritePrometheus(w io.Writer, im *idem.Metrics) error {
	p := &promWriter{w: w}
	p.counter("orders_created_total", "Orders written by the create handler.", m.OrdersCreated.Load())
	p.counter("orders_payments_succeeded_total", "Payments the gateway made or replayed.", m.PaymentsMade.Load())
	p.counter("orders_payments_found_total", "Payments of an earlier attempt found at the gateway by the order's reference, used instead of paying.", m.PaymentsFound.Load())
	p.counter("orders_payments_declined_total", "Payments the gateway declined.", m.PaymentsDeclined.Load())
	p.counter("orders_payment_gateway_errors_total", "Payment attempts that failed for another reason than a decline.", m.GatewayErrors.Load())
	p.counter("orders_unwritable_total", "Paid orders that the database refused for good, whose payment is refunded.", m.OrdersUnwritable.Load())
	p.counter("orders_payments_refunded_total", "Refunds the gateway made or replayed, of payments whose order could not be written.", m.PaymentsRefunded.Load())
	p.counter("orders_refund_errors_total", "Refund attempts that failed.", m.RefundErrors.Load())

	m.mu.Lock()
	labels := make([]responseLabel, 0, len(m.responses))
	for l := range m.responses {
		labels = append(labels, l)
	}
	slices.SortFunc(labels, func(a, b responseLabel) int {
		if a.route != b.route {
			if a.route < b.route {
				return -1
			}
			return 1
		}
		return a.code - b.code
	})
	counts := make([]int64, len(labels))
	for i, l := range labels {
		counts[i] = m.responses[l]
	}
	m.mu.Unlock()
	p.head("orders_http_responses_total", "HTTP responses by route and status code.")
	for i, l := range labels {
		p.printf("orders_http_responses_total{route=%q,code=\"%d\"} %d\n", l.route, l.code, counts[i])
	}

	if im != nil {
		for _, c := range []struct {
			name, help string
			v          *atomic.Int64
		}{
			{"idem_executions_total", "Handler runs under a claimed Idempotency-Key.", &im.Executions},
			{"idem_completed_total", "Outcomes committed and stored for replay.", &im.Completed},
			{"idem_replays_total", "Answers replayed from the store.", &im.Replays},
			{"idem_conflicts_total", "Requests answered 409: same key in flight.", &im.Conflicts},
			{"idem_mismatches_total", "Requests answered 422: key reused with another request.", &im.Mismatches},
			{"idem_released_total", "Keys freed after a refused (4xx) request.", &im.Released},
			{"idem_failed_total", "5xx answers and panics; key kept for a retry.", &im.Failed},
			{"idem_given_up_total", "Keys the completer re-drove for the last time without an outcome; left for an operator.", &im.GivenUp},
			{"idem_fenced_total", "Attempts refused at commit because their lease was taken over.", &im.Fenced},
			{"idem_store_errors_total", "Idempotency store calls that failed.", &im.StoreErrors},
			{"idem_unprotected_total", "Requests let through without an Idempotency-Key.", &im.Unprotected},
			{"idem_invalid_total", "Requests refused for a missing or invalid Idempotency-Key.", &im.Invalid},
			{"idem_oversize_responses_total", "Responses too large to store.", &im.OversizeBody},
		} {
			p.counter(c.name, c.help, c.v.Load())
		}
	}
	return p.err
}

type promWriter struct {
	w   io.Writer
	err error
}

func (p *promWriter) printf(format string, args ...any) {
	if p.err == nil {
		_, p.err = fmt.Fprintf(p.w, format, args...)
	}
}

func (p *promWriter) head(name, help string) {
	p.printf("# HELP %s %s\n# TYPE %s counter\n", name, help, name)
}

func (p *promWriter) counter(name, help string, v int64) {
	p.head(name, help)
	p.printf("%s %s\n", name, strconv.FormatInt(v, 10))
}

// statusWriter remembers the status code of a response.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.code == 0 {
		w.code = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.code == 0 {
		w.code = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// Flush keeps http.Flusher working through the wrapper.
func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}
