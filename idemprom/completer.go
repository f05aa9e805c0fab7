package idemprom

import (
	"context"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idem-go/idem"
)

// CompleterMetrics counts what completers did, fed by their
// idem.CompleterOptions.OnScan (set it to the OnScan method):
//
//	idem_completer_scans_total                    scans for abandoned requests
//	idem_completer_scan_errors_total              scans that failed (the listing or a cancelled scan)
//	idem_completer_redriven_total{result}         re-drives, result "completed" (a stored outcome) or "failed" (none: the key waits for the next)
//	idem_completer_skipped_total                  listed keys left alone: another attempt held them, or their operation was over
//
// The keys given up on are idem_given_up_total (NewCollector). It is a
// prometheus.Collector; register it.
type CompleterMetrics struct {
	scans, scanErrors, skipped prometheus.Counter
	completed, failed          prometheus.Counter
	redriven                   *prometheus.CounterVec
}

// NewCompleterMetrics returns CompleterMetrics at zero.
func NewCompleterMetrics() *CompleterMetrics {
	m := &CompleterMetrics{
		scans:      prometheus.NewCounter(prometheus.CounterOpts{Name: "idem_completer_scans_total", Help: "Scans of the completer for abandoned requests."}),
		scanErrors: prometheus.NewCounter(prometheus.CounterOpts{Name: "idem_completer_scan_errors_total", Help: "Scans of the completer that failed (the listing of abandoned requests, or a scan cut short)."}),
		skipped:    prometheus.NewCounter(prometheus.CounterOpts{Name: "idem_completer_skipped_total", Help: "Abandoned requests a scan listed but left alone: another attempt held them, or their operation was over."}),
		redriven: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "idem_completer_redriven_total",
			Help: "Abandoned requests the completer re-drove, by result: completed (an outcome stored) or failed (none; the key waits for the next re-drive or is given up)."}, []string{"result"}),
	}
	m.completed = m.redriven.WithLabelValues("completed")
	m.failed = m.redriven.WithLabelValues("failed")
	return m
}

// OnScan counts one scan; it is an idem.CompleterOptions.OnScan. A scan
// cut short by the cancellation of ctx (the completer stopping) is not
// counted as an error.
func (m *CompleterMetrics) OnScan(ctx context.Context, st idem.CompleterStats, err error) {
	m.scans.Inc()
	if err != nil && ctx.Err() == nil {
		m.scanErrors.Inc()
	}
	m.completed.Add(float64(st.Completed))
	m.failed.Add(float64(st.Failed))
	m.skipped.Add(float64(st.Skipped))
}

// Describe implements prometheus.Collector.
func (m *CompleterMetrics) Describe(ch chan<- *prometheus.Desc) {
	m.scans.Describe(ch)
	m.scanErrors.Describe(ch)
	m.skipped.Describe(ch)
	m.redriven.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *CompleterMetrics) Collect(ch chan<- prometheus.Metric) {
	m.scans.Collect(ch)
	m.scanErrors.Collect(ch)
	m.skipped.Collect(ch)
	m.redriven.Collect(ch)
}
