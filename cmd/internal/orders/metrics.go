package orders

import (
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemprom"
)

// Metrics counts what the order handler did. The zero value is ready; all
// fields are safe for concurrent use. It is a prometheus.Collector of the
// orders_* metrics:
//
//	orders_created_total                             counter
//	orders_payments_succeeded_total                  counter
//	orders_payments_found_total                      counter
//	orders_payments_declined_total                   counter
//	orders_payment_gateway_errors_total              counter
//	orders_unwritable_total                          counter
//	orders_payments_refunded_total                   counter
//	orders_refund_errors_total                       counter
//	orders_http_responses_total{route,code}          counter
//	orders_http_request_duration_seconds{route}      histogram
type Metrics struct {
	OrdersCreated    atomic.Int64 // orders written (committed or not: a fenced attempt rolls back)
	PaymentsMade     atomic.Int64 // Pay calls that succeeded (gateway replays included)
	PaymentsFound    atomic.Int64 // payments of an earlier attempt found by FindPayment, used instead of paying
	PaymentsDeclined atomic.Int64 // Pay calls declined
	GatewayErrors    atomic.Int64 // Pay calls that failed otherwise
	OrdersUnwritable atomic.Int64 // paid orders the database refused for good
	PaymentsRefunded atomic.Int64 // Refund calls that succeeded (gateway replays included)
	RefundErrors     atomic.Int64 // Refund calls that failed

	once      sync.Once
	responses *prometheus.CounterVec   // orders_http_responses_total{route,code}
	durations *prometheus.HistogramVec // orders_http_request_duration_seconds{route}
}

// HTTPBuckets are the buckets of orders_http_request_duration_seconds, in
// seconds: up to the payment timeout's default (20s) and beyond.
var HTTPBuckets = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 30}

func (m *Metrics) init() {
	m.once.Do(func() {
		m.responses = prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "orders_http_responses_total",
			Help: "HTTP responses by route and status code.",
		}, []string{"route", "code"})
		m.durations = prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "orders_http_request_duration_seconds",
			Help:    "Time from a request's headers to the end of its handler, by route.",
			Buckets: HTTPBuckets,
		}, []string{"route"})
	})
}

// observe counts one answer of route with status code, which took d.
func (m *Metrics) observe(route string, code int, d time.Duration) {
	m.init()
	m.responses.WithLabelValues(route, strconv.Itoa(code)).Inc()
	m.durations.WithLabelValues(route).Observe(d.Seconds())
}

// metricCounters are the counters of Metrics, by metric name.
var metricCounters = []struct {
	desc *prometheus.Desc
	v    func(m *Metrics) *atomic.Int64
}{
	{prometheus.NewDesc("orders_created_total", "Orders written by the create handler.", nil, nil), func(m *Metrics) *atomic.Int64 { return &m.OrdersCreated }},
	{prometheus.NewDesc("orders_payments_succeeded_total", "Payments the gateway made or replayed.", nil, nil), func(m *Metrics) *atomic.Int64 { return &m.PaymentsMade }},
	{prometheus.NewDesc("orders_payments_found_total", "Payments of an earlier attempt found at the gateway by the order's reference, used instead of paying.", nil, nil), func(m *Metrics) *atomic.Int64 { return &m.PaymentsFound }},
	{prometheus.NewDesc("orders_payments_declined_total", "Payments the gateway declined.", nil, nil), func(m *Metrics) *atomic.Int64 { return &m.PaymentsDeclined }},
	{prometheus.NewDesc("orders_payment_gateway_errors_total", "Payment attempts that failed for another reason than a decline.", nil, nil), func(m *Metrics) *atomic.Int64 { return &m.GatewayErrors }},
	{prometheus.NewDesc("orders_unwritable_total", "Paid orders that the database refused for good, whose payment is refunded.", nil, nil), func(m *Metrics) *atomic.Int64 { return &m.OrdersUnwritable }},
	{prometheus.NewDesc("orders_payments_refunded_total", "Refunds the gateway made or replayed, of payments whose order could not be written.", nil, nil), func(m *Metrics) *atomic.Int64 { return &m.PaymentsRefunded }},
	{prometheus.NewDesc("orders_refund_errors_total", "Refund attempts that failed.", nil, nil), func(m *Metrics) *atomic.Int64 { return &m.RefundErrors }},
}

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	m.init()
	for _, c := range metricCounters {
		ch <- c.desc
	}
	m.responses.Describe(ch)
	m.durations.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	m.init()
	for _, c := range metricCounters {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, float64(c.v(m).Load()))
	}
	m.responses.Collect(ch)
	m.durations.Collect(ch)
}

// NewRegistry returns a registry of m and of the middleware's counters im
// (when not nil): what GET /metrics serves unless Config.Gatherer is set.
func NewRegistry(m *Metrics, im *idem.Metrics) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(m)
	if im != nil {
		reg.MustRegister(idemprom.NewCollector(im))
	}
	return reg
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
