package orders

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemotel"
	"github.com/idem-go/idem/sqlitestore"
)

// obsTraced is the order API on SQLite with a span recorder, the store
// wrapped by idemotel and logs (with trace ids) in a buffer.
type obsTraced struct {
	*testBundle
	h    http.Handler
	rec  *tracetest.SpanRecorder
	logs *bytes.Buffer
}

func obsSetupTraced(t *testing.T) *obsTraced {
	t.Helper()
	ctx := context.Background()
	b := newBundle()
	st, err := sqlitestore.Open(ctx, filepath.Join(t.TempDir(), "orders.db"), sqlitestore.Options{Now: b.clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if err := MigrateSQLite(ctx, st.DB()); err != nil {
		t.Fatal(err)
	}
	b.store = st
	b.repo = NewSQLiteRepository(st.DB(), sqlitestore.FromContext)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { tp.Shutdown(context.Background()) })
	logs := new(bytes.Buffer)
	h := NewHandler(Config{
		Repo:           b.repo,
		Payer:          b.payer,
		Idem:           idemotel.WrapStore(st, idemotel.Options{TracerProvider: tp}),
		IdemOptions:    idem.Options{User: idem.SharedKeySpace, Metrics: b.idemM},
		Secret:         b.secret,
		Now:            b.clock.Now,
		Logger:         slog.New(idemotel.LogHandler(slog.NewTextHandler(logs, nil))),
		Metrics:        b.metrics,
		TracerProvider: tp,
		Propagator:     propagation.TraceContext{},
	})
	return &obsTraced{testBundle: b, h: h, rec: rec, logs: logs}
}

// serve runs one request through the handler, in this goroutine: every
// span has ended when it returns.
func (o *obsTraced) serve(t *testing.T, r req) *httptest.ResponseRecorder {
	t.Helper()
	hr := httptest.NewRequest(r.method, r.path, strings.NewReader(r.body))
	if r.body != "" {
		hr.Header.Set("Content-Type", "application/json")
	}
	if r.token != "" {
		hr.Header.Set("Authorization", "Bearer "+r.token)
	}
	if r.key != "" {
		hr.Header.Set("Idempotency-Key", r.key)
	}
	for k, v := range r.header {
		hr.Header.Set(k, v)
	}
	w := httptest.NewRecorder()
	o.h.ServeHTTP(w, hr)
	return w
}

// spans returns the spans ended since the last call, by name.
func (o *obsTraced) spans() map[string][]sdktrace.ReadOnlySpan {
	out := map[string][]sdktrace.ReadOnlySpan{}
	for _, s := range o.rec.Ended() {
		out[s.Name()] = append(out[s.Name()], s)
	}
	o.rec.Reset()
	return out
}

func obsAttr(s sdktrace.ReadOnlySpan, k attribute.Key) (attribute.Value, bool) {
	for _, kv := range s.Attributes() {
		if kv.Key == k {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

// obsOne returns the only span named name, failing the test otherwise,
// and checks that it is a child of parent (a root span if parent is
// the zero SpanContext).
func obsOne(t *testing.T, spans map[string][]sdktrace.ReadOnlySpan, name string, parent trace.SpanContext) sdktrace.ReadOnlySpan {
	t.Helper()
	if len(spans[name]) != 1 {
		t.Fatalf("%d spans %s, want 1 (spans: %v)", len(spans[name]), name, obsNames(spans))
	}
	s := spans[name][0]
	if !parent.IsValid() { // a root span
		if s.Parent().IsValid() {
			t.Errorf("%s: parent %v, want none", name, s.Parent())
		}
		return s
	}
	if s.Parent().SpanID() != parent.SpanID() || s.SpanContext().TraceID() != parent.TraceID() {
		t.Errorf("%s: parent %v, want the server span %v", name, s.Parent(), parent)
	}
	return s
}

func obsNames(spans map[string][]sdktrace.ReadOnlySpan) []string {
	var names []string
	for n, ss := range spans {
		for range ss {
			names = append(names, n)
		}
	}
	return names
}

func obsWant(t *testing.T, s sdktrace.ReadOnlySpan, k attribute.Key, want any) {
	t.Helper()
	v, ok := obsAttr(s, k)
	if !ok {
		t.Errorf("%s has no %s (attributes %v)", s.Name(), k, s.Attributes())
		return
	}
	if got := v.AsInterface(); got != want {
		t.Errorf("%s %s = %v (%T), want %v (%T)", s.Name(), k, got, got, want, want)
	}
}

// obsNoSecrets checks that no attribute of any span holds one of secrets.
func obsNoSecrets(t *testing.T, spans map[string][]sdktrace.ReadOnlySpan, secrets ...string) {
	t.Helper()
	for _, ss := range spans {
		for _, s := range ss {
			for _, kv := range s.Attributes() {
				for _, sec := range secrets {
					if strings.Contains(kv.Value.String(), sec) {
						t.Errorf("span %s attribute %s = %q holds %q", s.Name(), kv.Key, kv.Value.String(), sec)
					}
				}
			}
		}
	}
}

// A keyed create makes the server span with the claim, the handler and
// the completion under it, with the key's outcome; a replay makes a claim
// span (replayed) and no handler span; a failed attempt makes a fail span
// and its log lines carry the trace id; the key, the user and the body
// are never in an attribute.
func TestTraceKeyedRequest(t *testing.T) {
	o := obsSetupTraced(t)
	const user, key = "obs-user-carol", "obs-key-5e1f0c"
	secrets := []string{user, key, "SKU-1"}
	tok := o.token(t, user)

	// The first attempt: claimed, run, stored.
	if w := o.serve(t, req{method: "POST", path: "/v1/orders", token: tok, key: key, body: orderBody}); w.Code != http.StatusCreated {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	spans := o.spans()
	obsNoSecrets(t, spans, secrets...)
	srv := spans["POST /v1/orders"]
	if len(srv) != 1 {
		t.Fatalf("server spans %v, want one POST /v1/orders", obsNames(spans))
	}
	if srv[0].SpanKind() != trace.SpanKindServer {
		t.Errorf("server span kind %v", srv[0].SpanKind())
	}
	obsWant(t, srv[0], "http.route", "/v1/orders")
	obsWant(t, srv[0], "http.request.method", "POST")
	obsWant(t, srv[0], "http.response.status_code", int64(201))
	sc := srv[0].SpanContext()
	claim := obsOne(t, spans, idemotel.SpanClaim, sc)
	obsWant(t, claim, idemotel.AttrOutcome, idemotel.OutcomeClaimed)
	obsWant(t, claim, idemotel.AttrAttempt, int64(1))
	handler := obsOne(t, spans, idemotel.SpanHandler, sc)
	obsWant(t, handler, idemotel.AttrStatus, int64(201))
	obsWant(t, handler, idemotel.AttrAttempt, int64(1))
	complete := obsOne(t, spans, idemotel.SpanComplete, sc)
	obsWant(t, complete, idemotel.AttrOutcome, idemotel.OutcomeStored)
	obsWant(t, complete, idemotel.AttrStatus, int64(201))
	op, _ := obsAttr(claim, idemotel.AttrOperation)
	if op2, _ := obsAttr(complete, idemotel.AttrOperation); op.AsString() == "" || op2.AsString() != op.AsString() {
		t.Errorf("operation ids: claim %q, complete %q; want the same, set", op.AsString(), op2.AsString())
	}
	if claim.EndTime().After(handler.StartTime()) || handler.EndTime().After(complete.StartTime()) {
		t.Errorf("spans out of order: claim %v–%v, handler %v–%v, complete %v–%v", claim.StartTime(), claim.EndTime(),
			handler.StartTime(), handler.EndTime(), complete.StartTime(), complete.EndTime())
	}

	// A replay: the claim answers, the handler does not run.
	if w := o.serve(t, req{method: "POST", path: "/v1/orders", token: tok, key: key, body: orderBody}); w.Code != http.StatusCreated || w.Header().Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %d %s", w.Code, w.Body)
	}
	spans = o.spans()
	obsNoSecrets(t, spans, secrets...)
	sc = obsOne(t, spans, "POST /v1/orders", trace.SpanContext{}).SpanContext()
	claim = obsOne(t, spans, idemotel.SpanClaim, sc)
	obsWant(t, claim, idemotel.AttrOutcome, idemotel.OutcomeReplayed)
	obsWant(t, claim, idemotel.AttrStatus, int64(201))
	if n := len(spans[idemotel.SpanHandler]) + len(spans[idemotel.SpanComplete]); n != 0 {
		t.Errorf("a replay made %d handler or complete spans: %v", n, obsNames(spans))
	}

	// The same key with another body: mismatch.
	other := strings.Replace(orderBody, `"quantity":2`, `"quantity":3`, 1)
	if w := o.serve(t, req{method: "POST", path: "/v1/orders", token: tok, key: key, body: other}); w.Code != http.StatusUnprocessableEntity {
		t.Fatalf("mismatch: %d %s", w.Code, w.Body)
	}
	spans = o.spans()
	sc = obsOne(t, spans, "POST /v1/orders", trace.SpanContext{}).SpanContext()
	obsWant(t, obsOne(t, spans, idemotel.SpanClaim, sc), idemotel.AttrOutcome, idemotel.OutcomeMismatch)
	if len(spans[idemotel.SpanHandler]) != 0 {
		t.Errorf("a mismatch ran the handler")
	}

	// A gateway failure: the attempt fails (key kept), logged with the
	// trace id; the retry is attempt 2 and stores.
	const key2 = "obs-key-9b2d77"
	o.payer.mu.Lock()
	o.payer.failBefore = 1
	o.payer.mu.Unlock()
	if w := o.serve(t, req{method: "POST", path: "/v1/orders", token: tok, key: key2, body: orderBody}); w.Code != http.StatusBadGateway {
		t.Fatalf("failing gateway: %d %s", w.Code, w.Body)
	}
	spans = o.spans()
	obsNoSecrets(t, spans, user, key2, "SKU-1")
	srvSpan := obsOne(t, spans, "POST /v1/orders", trace.SpanContext{})
	sc = srvSpan.SpanContext()
	if srvSpan.Status().Code != codes.Error {
		t.Errorf("server span of a 502: status %v, want Error", srvSpan.Status())
	}
	handler = obsOne(t, spans, idemotel.SpanHandler, sc)
	obsWant(t, handler, idemotel.AttrStatus, int64(502))
	obsWant(t, obsOne(t, spans, idemotel.SpanFail, sc), idemotel.AttrOutcome, idemotel.OutcomeFailed)
	var logged bool
	for _, line := range strings.Split(o.logs.String(), "\n") {
		if strings.Contains(line, "orders: payment failed") {
			logged = true
			if !strings.Contains(line, "trace_id="+sc.TraceID().String()) || !strings.Contains(line, "span_id="+handler.SpanContext().SpanID().String()) {
				t.Errorf("log line without the request's trace and handler span ids %s/%s: %s", sc.TraceID(), handler.SpanContext().SpanID(), line)
			}
		}
	}
	if !logged {
		t.Errorf("no log of the failed payment:\n%s", o.logs)
	}
	if w := o.serve(t, req{method: "POST", path: "/v1/orders", token: tok, key: key2, body: orderBody}); w.Code != http.StatusCreated {
		t.Fatalf("retry: %d %s", w.Code, w.Body)
	}
	spans = o.spans()
	sc = obsOne(t, spans, "POST /v1/orders", trace.SpanContext{}).SpanContext()
	claim = obsOne(t, spans, idemotel.SpanClaim, sc)
	obsWant(t, claim, idemotel.AttrOutcome, idemotel.OutcomeClaimed)
	obsWant(t, claim, idemotel.AttrAttempt, int64(2))
	obsWant(t, obsOne(t, spans, idemotel.SpanComplete, sc), idemotel.AttrOutcome, idemotel.OutcomeStored)

	// A request refused on its first attempt frees its key: released.
	if w := o.serve(t, req{method: "POST", path: "/v1/orders", token: tok, key: "obs-key-bad", body: `{"items":[],"currency":"EUR"}`}); w.Code != http.StatusBadRequest {
		t.Fatalf("invalid order: %d %s", w.Code, w.Body)
	}
	spans = o.spans()
	sc = obsOne(t, spans, "POST /v1/orders", trace.SpanContext{}).SpanContext()
	obsWant(t, obsOne(t, spans, idemotel.SpanRelease, sc), idemotel.AttrOutcome, idemotel.OutcomeReleased)
	obsWant(t, obsOne(t, spans, idemotel.SpanHandler, sc), idemotel.AttrStatus, int64(400))
}

// The server span joins the caller's trace (traceparent), is named by the
// route and never carries the raw path; GET /v1/orders/{id} is one route.
func TestTraceServerSpan(t *testing.T) {
	o := obsSetupTraced(t)
	const parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	w := o.serve(t, req{method: "GET", path: "/v1/orders/ord_obs_secret_id", token: o.token(t, "obs-user-dave"), header: map[string]string{"Traceparent": parent}})
	if w.Code != http.StatusNotFound {
		t.Fatalf("get: %d %s", w.Code, w.Body)
	}
	spans := o.spans()
	obsNoSecrets(t, spans, "obs-user-dave", "ord_obs_secret_id")
	ss := spans["GET /v1/orders/{id}"]
	if len(ss) != 1 {
		t.Fatalf("spans %v, want one GET /v1/orders/{id}", obsNames(spans))
	}
	s := ss[0]
	if got := s.SpanContext().TraceID().String(); got != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("trace id %s, want the traceparent's", got)
	}
	if got := s.Parent().SpanID().String(); got != "00f067aa0ba902b7" || !s.Parent().IsRemote() {
		t.Errorf("parent %s (remote %v), want the traceparent's span", got, s.Parent().IsRemote())
	}
	obsWant(t, s, "http.route", "/v1/orders/{id}")
	obsWant(t, s, "http.response.status_code", int64(404))

	// An unknown path: named by the method, no route.
	o.serve(t, req{method: "BREW", path: "/coffee/obs-secret-path"})
	spans = o.spans()
	obsNoSecrets(t, spans, "obs-secret-path", "BREW")
	if len(spans["_OTHER"]) != 1 {
		t.Fatalf("spans %v, want one _OTHER", obsNames(spans))
	}
	if _, ok := obsAttr(spans["_OTHER"][0], "http.route"); ok {
		t.Errorf("an unrouted request has http.route")
	}
}

// GET /metrics has the latency histogram by route, with the counts of
// the requests made.
func TestMetricsRequestDuration(t *testing.T) {
	o := obsSetupTraced(t)
	tok := o.token(t, "obs-user-erin")
	for i := 0; i < 3; i++ {
		o.serve(t, req{method: "POST", path: "/v1/orders", token: tok, key: "obs-dur", body: orderBody})
	}
	o.serve(t, req{method: "GET", path: "/healthz"})
	w := o.serve(t, req{method: "GET", path: "/metrics"})
	body, _ := io.ReadAll(w.Body)
	if w.Code != http.StatusOK || w.Header().Get("Cache-Control") != "no-store" {
		t.Fatalf("metrics: %d %v", w.Code, w.Header())
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"orders_http_request_duration_seconds_count", map[string]string{"route": "POST /v1/orders"}, 3},
		{"orders_http_request_duration_seconds_count", map[string]string{"route": "GET /healthz"}, 1},
		{"orders_http_request_duration_seconds_bucket", map[string]string{"route": "POST /v1/orders", "le": "+Inf"}, 3},
		{"orders_http_responses_total", map[string]string{"route": "POST /v1/orders", "code": "201"}, 3},
		{"idem_replays_total", nil, 2},
	} {
		if v, ok := promSample(string(body), c.name, c.labels); !ok || v != c.want {
			t.Errorf("%s%v = %v (found %v), want %v", c.name, c.labels, v, ok, c.want)
		}
	}
	if !strings.Contains(string(body), "# TYPE orders_http_request_duration_seconds histogram") {
		t.Errorf("no histogram type line:\n%s", body)
	}
	// OpenMetrics when asked for.
	w = o.serve(t, req{method: "GET", path: "/metrics", header: map[string]string{"Accept": "application/openmetrics-text; version=1.0.0"}})
	if ct := w.Header().Get("Content-Type"); w.Code != http.StatusOK || !strings.HasPrefix(ct, "application/openmetrics-text") ||
		!strings.HasSuffix(w.Body.String(), "# EOF\n") || !strings.Contains(w.Body.String(), "\norders_created_total 1.0\n") {
		t.Errorf("OpenMetrics: %d %s\n%s", w.Code, ct, w.Body)
	}
}
