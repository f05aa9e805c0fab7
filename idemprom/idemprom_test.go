package idemprom_test

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/idemprom"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/storetest"
)

// obsGather gathers reg into name{labels} → value: counters' values,
// histograms' sample counts.
func obsGather(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+"="+l.GetValue())
			}
			name := mf.GetName()
			if len(ls) > 0 {
				name += "{" + strings.Join(ls, ",") + "}"
			}
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				out[name] = m.GetCounter().GetValue()
			case dto.MetricType_HISTOGRAM:
				out[name] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out
}

// Every counter of idem.Metrics is exported under its name, with its value.
func TestCollectorCounters(t *testing.T) {
	m := new(idem.Metrics)
	set := []struct {
		name string
		add  func(int64)
	}{
		{"idem_executions_total", func(n int64) { m.Executions.Add(n) }},
		{"idem_completed_total", func(n int64) { m.Completed.Add(n) }},
		{"idem_replays_total", func(n int64) { m.Replays.Add(n) }},
		{"idem_conflicts_total", func(n int64) { m.Conflicts.Add(n) }},
		{"idem_mismatches_total", func(n int64) { m.Mismatches.Add(n) }},
		{"idem_released_total", func(n int64) { m.Released.Add(n) }},
		{"idem_failed_total", func(n int64) { m.Failed.Add(n) }},
		{"idem_given_up_total", func(n int64) { m.GivenUp.Add(n) }},
		{"idem_fenced_total", func(n int64) { m.Fenced.Add(n) }},
		{"idem_store_errors_total", func(n int64) { m.StoreErrors.Add(n) }},
		{"idem_store_retries_total", func(n int64) { m.StoreRetries.Add(n) }},
		{"idem_unprotected_total", func(n int64) { m.Unprotected.Add(n) }},
		{"idem_invalid_total", func(n int64) { m.Invalid.Add(n) }},
		{"idem_oversize_responses_total", func(n int64) { m.OversizeBody.Add(n) }},
	}
	for i, s := range set {
		s.add(int64(i + 1))
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(idemprom.NewCollector(m))
	got := obsGather(t, reg)
	if len(got) != len(set) {
		t.Errorf("%d metrics, want %d: %v", len(got), len(set), got)
	}
	for i, s := range set {
		if v, ok := got[s.name]; !ok || v != float64(i+1) {
			t.Errorf("%s = %v (found %v), want %d", s.name, v, ok, i+1)
		}
	}
}

// onlyStore hides every method of a store but idem.Store's.
type onlyStore struct{ idem.Store }

// The store wrapper times every call by operation, keeps the transaction
// reachable by memstore.FromContext, and is a Sweeper exactly when the
// store is.
func TestStoreMetrics(t *testing.T) {
	sm := idemprom.NewStoreMetrics()
	reg := prometheus.NewRegistry()
	reg.MustRegister(sm)
	mem := memstore.New(memstore.Options{})
	st := sm.Wrap(mem)
	if _, ok := sm.Wrap(onlyStore{mem}).(idemdriver.Sweeper); ok {
		t.Errorf("the wrapper of a store without Sweeper is a Sweeper")
	}
	if u, ok := st.(interface{ Unwrap() idem.Store }); !ok || u.Unwrap() != mem {
		t.Errorf("Unwrap does not return the store")
	}
	h := idem.Middleware(st, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := memstore.FromContext(r.Context()); err != nil {
			t.Errorf("memstore.FromContext through the wrapper: %v", err)
		}
		w.WriteHeader(http.StatusCreated)
	}))
	for range 2 {
		r := httptest.NewRequest("POST", "/x", strings.NewReader(`{}`))
		r.Header.Set("Idempotency-Key", "k1")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != http.StatusCreated {
			t.Fatalf("status %d", w.Code)
		}
	}
	sw, ok := st.(idemdriver.Sweeper)
	if !ok {
		t.Fatal("the wrapper of memstore is not a Sweeper")
	}
	ctx := context.Background()
	if _, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10}); err != nil {
		t.Fatal(err)
	}
	if _, err := sw.DeleteExpired(ctx, 10); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Get(ctx, "", "k1"); err != nil {
		t.Fatal(err)
	}
	got := obsGather(t, reg)
	for op, want := range map[string]float64{"claim": 2, "begin": 1, "complete": 1, "rollback": 1, // the middleware rolls back after Complete (a no-op)
		"release": 0, "fail": 0,
		"get": 1, "abandoned": 1, "delete_expired": 1} {
		name := "idem_store_call_duration_seconds{operation=" + op + "}"
		if v, ok := got[name]; !ok || v != want {
			t.Errorf("%s count = %v (found %v), want %v", name, v, ok, want)
		}
	}
}

// The completer's OnScan feeds the scan and re-drive counters.
func TestCompleterMetrics(t *testing.T) {
	clock := storetest.NewClock(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC))
	mem := memstore.New(memstore.Options{Now: clock.Now})
	ctx := context.Background()
	for _, k := range []string{"done", "broken"} {
		if _, err := mem.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: k, Fingerprint: "f-" + k, Owner: idemdriver.NewOwner(),
			Method: "POST", Path: "/" + k, Body: []byte(`{}`), Lease: time.Second}); err != nil {
			t.Fatal(err)
		}
	}
	clock.Advance(2 * time.Second)
	cm, sm := idemprom.NewCompleterMetrics(), idemprom.NewStoreMetrics()
	reg := prometheus.NewRegistry()
	reg.MustRegister(cm, sm)
	c := idem.NewCompleter(sm.Wrap(mem).(idemdriver.SweepingStore), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/broken" {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}), idem.CompleterOptions{OnScan: cm.OnScan, Logger: slog.New(slog.DiscardHandler)})
	st, err := c.RunOnce(ctx)
	if err != nil || st.Completed != 1 || st.Failed != 1 {
		t.Fatalf("RunOnce: %+v, %v; want 1 completed, 1 failed", st, err)
	}
	got := obsGather(t, reg)
	for name, want := range map[string]float64{
		"idem_completer_scans_total":                            1,
		"idem_completer_scan_errors_total":                      0,
		"idem_completer_redriven_total{result=completed}":       1,
		"idem_completer_redriven_total{result=failed}":          1,
		"idem_completer_skipped_total":                          0,
		"idem_store_call_duration_seconds{operation=abandoned}": 1,
	} {
		if v, ok := got[name]; !ok || v != want {
			t.Errorf("%s = %v (found %v), want %v", name, v, ok, want)
		}
	}
	// A scan whose listing fails counts as an error; one cut short by the
	// completer's stop does not.
	failing := idem.NewCompleter(failingSweeper{mem}, http.NotFoundHandler(), idem.CompleterOptions{OnScan: cm.OnScan, Logger: slog.New(slog.DiscardHandler)})
	if _, err := failing.RunOnce(ctx); err == nil {
		t.Fatal("the failing listing did not fail")
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, _ = failing.RunOnce(cctx) // canceled: counted as a scan, not a scan error
	got = obsGather(t, reg)
	if got["idem_completer_scans_total"] != 3 || got["idem_completer_scan_errors_total"] != 1 {
		t.Errorf("scans %v, errors %v; want 3 and 1", got["idem_completer_scans_total"], got["idem_completer_scan_errors_total"])
	}
}

type failingSweeper struct{ *memstore.Store }

func (failingSweeper) Abandoned(context.Context, idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	return nil, context.DeadlineExceeded
}
