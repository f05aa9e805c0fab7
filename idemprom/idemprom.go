// Package idemprom exports what the idempotency middleware, its store and
// its completer do as Prometheus metrics (github.com/prometheus/client_golang).
// The idem package itself depends on no metrics library; this package is
// the glue:
//
//   - NewCollector: the middleware's counters (an *idem.Metrics) as the
//     idem_*_total counters.
//   - StoreMetrics: a histogram of store call latency by operation,
//     observed by a Store wrapper (StoreMetrics.Wrap).
//   - CompleterMetrics: counts of the completer's scans and re-drives,
//     fed by idem.CompleterOptions.OnScan.
//
// Register them in a prometheus.Registry and serve it with promhttp:
//
//	reg := prometheus.NewRegistry()
//	sm, cm := idemprom.NewStoreMetrics(), idemprom.NewCompleterMetrics()
//	reg.MustRegister(idemprom.NewCollector(metrics), sm, cm)
//	store = sm.Wrap(store)
//	completer := idem.NewCompleter(store, h, idem.CompleterOptions{OnScan: cm.OnScan, …})
package idemprom

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idem-go/idem"
)

// counter is one counter of idem.Metrics.
type counter struct {
	desc *prometheus.Desc
	v    func(m *idem.Metrics) *atomic.Int64
}

// counters are the middleware's counters, by metric name.
var counters = []counter{
	{prometheus.NewDesc("idem_executions_total", "Handler runs under a claimed Idempotency-Key.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.Executions }},
	{prometheus.NewDesc("idem_completed_total", "Outcomes committed and stored for replay.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.Completed }},
	{prometheus.NewDesc("idem_replays_total", "Answers replayed from the store.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.Replays }},
	{prometheus.NewDesc("idem_conflicts_total", "Requests answered 409: same key in flight.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.Conflicts }},
	{prometheus.NewDesc("idem_mismatches_total", "Requests answered 422: key reused with another request.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.Mismatches }},
	{prometheus.NewDesc("idem_released_total", "Keys freed after a refused (4xx) request.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.Released }},
	{prometheus.NewDesc("idem_failed_total", "5xx answers and panics; key kept for a retry.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.Failed }},
	{prometheus.NewDesc("idem_given_up_total", "Keys the completer re-drove for the last time without an outcome; left for an operator.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.GivenUp }},
	{prometheus.NewDesc("idem_fenced_total", "Attempts refused at commit because their lease was taken over.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.Fenced }},
	{prometheus.NewDesc("idem_store_errors_total", "Idempotency store calls that failed.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.StoreErrors }},
	{prometheus.NewDesc("idem_store_retries_total", "Idempotency store calls sent again after an error.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.StoreRetries }},
	{prometheus.NewDesc("idem_unprotected_total", "Requests let through without an Idempotency-Key.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.Unprotected }},
	{prometheus.NewDesc("idem_invalid_total", "Requests refused for a missing or invalid Idempotency-Key.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.Invalid }},
	{prometheus.NewDesc("idem_oversize_responses_total", "Responses too large to store.", nil, nil), func(m *idem.Metrics) *atomic.Int64 { return &m.OversizeBody }},
}

// collector is NewCollector's.
type collector struct{ m *idem.Metrics }

// NewCollector returns a prometheus.Collector of the middleware's counters
// m (idem.Options.Metrics), read when scraped:
//
//	idem_executions_total          handler runs under a claimed key
//	idem_completed_total           outcomes committed and stored
//	idem_replays_total             answers replayed from the store
//	idem_conflicts_total           409: the key in flight
//	idem_mismatches_total          422: the key reused with another request
//	idem_released_total            keys freed after a refused (4xx) request
//	idem_failed_total              5xx answers and panics: the key kept for a retry
//	idem_given_up_total            keys a completer gave up on
//	idem_fenced_total              attempts refused at commit: lease lost
//	idem_store_errors_total        store calls that failed
//	idem_store_retries_total       store calls sent again after an error
//	idem_unprotected_total         requests let through without a key
//	idem_invalid_total             requests refused for a missing or bad key
//	idem_oversize_responses_total  answers too large to store
//
// It panics if m is nil.
func NewCollector(m *idem.Metrics) prometheus.Collector {
	if m == nil {
		panic("idemprom: NewCollector of nil *idem.Metrics")
	}
	return collector{m}
}

// Describe implements prometheus.Collector.
func (c collector) Describe(ch chan<- *prometheus.Desc) {
	for _, k := range counters {
		ch <- k.desc
	}
}

// Collect implements prometheus.Collector.
func (c collector) Collect(ch chan<- prometheus.Metric) {
	for _, k := range counters {
		ch <- prometheus.MustNewConstMetric(k.desc, prometheus.CounterValue, float64(k.v(c.m).Load()))
	}
}
