package ordersapp

import (
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/internal/pgtest"
)

// obsReceiver is an OTLP/HTTP trace receiver: it accepts POST /v1/traces
// (protobuf, gzip or not) and keeps the spans and resources received.
type obsReceiver struct {
	mu        sync.Mutex
	posts     int
	spans     []*tracepb.Span
	resources []*tracepb.ResourceSpans
	bad       []string
}

func (rc *obsReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if r.Method != http.MethodPost || r.URL.Path != "/v1/traces" || r.Header.Get("Content-Type") != "application/x-protobuf" {
		rc.bad = append(rc.bad, r.Method+" "+r.URL.Path+" "+r.Header.Get("Content-Type"))
		http.Error(w, "no", http.StatusNotFound)
		return
	}
	var body io.Reader = r.Body
	if r.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(r.Body)
		if err != nil {
			rc.bad = append(rc.bad, "gzip: "+err.Error())
			http.Error(w, "no", http.StatusBadRequest)
			return
		}
		body = zr
	}
	b, err := io.ReadAll(body)
	var req collectortrace.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(b, &req)
	}
	if err != nil {
		rc.bad = append(rc.bad, "body: "+err.Error())
		http.Error(w, "no", http.StatusBadRequest)
		return
	}
	rc.posts++
	for _, rs := range req.ResourceSpans {
		rc.resources = append(rc.resources, rs)
		for _, ss := range rs.ScopeSpans {
			rc.spans = append(rc.spans, ss.Spans...)
		}
	}
	out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	w.Write(out)
}

func obsPBAttr(attrs []*commonpb.KeyValue, k string) (string, bool) {
	for _, kv := range attrs {
		if kv.Key == k {
			switch v := kv.Value.Value.(type) {
			case *commonpb.AnyValue_StringValue:
				return v.StringValue, true
			case *commonpb.AnyValue_IntValue:
				return strconv.FormatInt(v.IntValue, 10), true
			case *commonpb.AnyValue_BoolValue:
				return strconv.FormatBool(v.BoolValue), true
			default:
				return kv.Value.String(), true
			}
		}
	}
	return "", false
}

// obsServe runs `orders serve` with env until the returned stop is called
// (which waits for it to end), and returns its base URL and JWT secret.
func obsServe(t *testing.T, env map[string]string, extra ...string) (base, metricsBase string, secret []byte, stop func(), logs *syncBuffer) {
	t.Helper()
	addr := freeAddr(t)
	const jwt = "obs-secret-0123456789abcdef0123456789"
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var out syncBuffer
	logs = new(syncBuffer)
	a := &App{Stdout: &out, Stderr: logs, Getenv: func(k string) string { return env[k] }}
	args := append([]string{"serve", "--data-dir", t.TempDir(), "--addr", addr, "--jwt-secret", jwt}, extra...)
	go func() { done <- a.Run(ctx, args) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case code := <-done:
			if code != 0 {
				t.Errorf("serve exited %d: %s", code, logs.String())
			}
		case <-time.After(30 * time.Second):
			t.Error("serve did not stop")
		}
	}
	t.Cleanup(stop)
	base, metricsBase = "http://"+addr, "http://"+addr
	for i, a := range extra {
		if a == "--metrics-addr" {
			metricsBase = "http://" + extra[i+1]
		}
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		resp, err := http.Get(base + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		select {
		case code := <-done:
			stopped = true
			t.Fatalf("serve exited %d: %s", code, logs.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("serve did not answer: %s", logs.String())
		}
		time.Sleep(20 * time.Millisecond) // a poll with a deadline: ends as soon as serve answers
	}
	return base, metricsBase, []byte(jwt), stop, logs
}

func obsPost(t *testing.T, base string, secret []byte, user, key string) int {
	t.Helper()
	tok, err := orders.IssueToken(secret, user, time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest("POST", base+"/v1/orders", strings.NewReader(`{"items":[{"sku":"OBS-SKU-SECRET","quantity":1,"unit_price":500}],"currency":"EUR"}`))
	req.Header.Set("Authorization", "Bearer "+tok)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// With OTEL_EXPORTER_OTLP_ENDPOINT set, serve exports its spans over
// OTLP/HTTP to <endpoint>/v1/traces, and flushes them when it stops: a
// create's server, claim, handler and complete spans and a replay's claim,
// under the service's name, with no key, user or body in an attribute.
// On PostgreSQL with Redis in front, the store wrappers stack on
// redisfront's (the handler still reaches its pgx transaction) and the
// Redis counters are on /metrics.
func TestServeExportsOTLP(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) { obsOTLP(t, false) })
	t.Run("postgres+redis", func(t *testing.T) { obsOTLP(t, true) })
}

func obsOTLP(t *testing.T, pgRedis bool) {
	// The receipts consumer's idem.Do spans (its claim and completion of
	// the order's event) would mix with the request's: it is off here.
	extra := []string{"--consume=false"}
	if pgRedis {
		rURL := redisURL(t)
		extra = append(extra, "--database-url", pgtest.Database(t), "--redis-url", rURL)
	}
	rc := new(obsReceiver)
	col := httptest.NewServer(rc)
	defer col.Close()
	base, _, secret, stop, _ := obsServe(t, map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": col.URL + "/"}, extra...)
	const user, key = "obs-user-hana", "obs-key-otlp-42"
	for i, want := range []int{http.StatusCreated, http.StatusCreated} {
		if got := obsPost(t, base, secret, user, key); got != want {
			t.Fatalf("request %d: %d, want %d", i, got, want)
		}
	}
	if pgRedis {
		resp, err := http.Get(base + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		m, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, want := range []string{"\nidem_redis_inner_claims_total ", "\nidem_redis_replays_total ", "\nidem_redis_errors_total 0\n", "\nidem_completed_total 1\n"} {
			if !strings.Contains(string(m), want) {
				t.Errorf("/metrics lacks %q", want)
			}
		}
	}
	stop()

	rc.mu.Lock()
	defer rc.mu.Unlock()
	if len(rc.bad) > 0 {
		t.Errorf("the receiver refused: %q", rc.bad)
	}
	if rc.posts == 0 {
		t.Fatal("no export reached the receiver")
	}
	for _, rs := range rc.resources {
		if name, _ := obsPBAttr(rs.Resource.GetAttributes(), "service.name"); name != "orders" {
			t.Errorf("service.name = %q, want orders", name)
		}
	}
	outcomes := map[string][]string{}
	for _, s := range rc.spans {
		o, _ := obsPBAttr(s.Attributes, "idem.outcome")
		outcomes[s.Name] = append(outcomes[s.Name], o)
		for _, kv := range s.Attributes {
			v, _ := obsPBAttr([]*commonpb.KeyValue{kv}, kv.Key)
			for _, sec := range []string{user, key, "OBS-SKU-SECRET"} {
				if strings.Contains(v, sec) {
					t.Errorf("span %s attribute %s = %q holds %q", s.Name, kv.Key, v, sec)
				}
			}
		}
	}
	t.Logf("%d exports, spans by name and outcome: %v", rc.posts, outcomes)
	for name, want := range map[string][]string{
		"POST /v1/orders": {"", ""},
		"idem.claim":      {"claimed", "replayed"},
		"idem.handler":    {""},
		"idem.complete":   {"stored"},
	} {
		if got := outcomes[name]; strings.Join(got, ",") != strings.Join(want, ",") {
			t.Errorf("spans %s: outcomes %q, want %q", name, got, want)
		}
	}
}

// Without an endpoint no tracer is built; the environment's settings are
// read as the OpenTelemetry variables say, and a wrong one stops serve.
func TestTracerEnv(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		env     map[string]string
		on      bool
		errPart string
	}{
		{env: nil},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, on: true},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://collector.example:4318/v1/traces"}, on: true},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_SDK_DISABLED": "true"}},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_EXPORTER": "none"}},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_TRACES_EXPORTER": "zipkin"}, errPart: "OTEL_TRACES_EXPORTER"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "127.0.0.1:4318"}, errPart: "OTEL_EXPORTER_OTLP_ENDPOINT"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, errPart: "http/protobuf"},
		{env: map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, on: true},
	} {
		tp, err := newTracerProvider(ctx, func(k string) string { return tc.env[k] })
		switch {
		case tc.errPart != "":
			if err == nil || !strings.Contains(err.Error(), tc.errPart) {
				t.Errorf("%v: error %v, want one naming %s", tc.env, err, tc.errPart)
			}
		case err != nil:
			t.Errorf("%v: %v", tc.env, err)
		case (tp != nil) != tc.on:
			t.Errorf("%v: tracing %v, want %v", tc.env, tp != nil, tc.on)
		}
		if tp != nil {
			tp.Shutdown(ctx)
		}
	}
	// serve refuses to start on a wrong setting, naming it.
	a := &App{Stdout: io.Discard, Stderr: new(bytes.Buffer), Getenv: func(k string) string {
		return map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost:4318"}[k]
	}}
	if code := a.Run(ctx, []string{"serve", "--data-dir", t.TempDir(), "--addr", "127.0.0.1:0"}); code == 0 || !strings.Contains(a.Stderr.(*bytes.Buffer).String(), "OTEL_EXPORTER_OTLP_ENDPOINT") {
		t.Errorf("serve with a bad endpoint: exit %d, %s", code, a.Stderr)
	}
}

// GET /metrics (here on --metrics-addr) has every metric family the
// service registers: the order handler's, the middleware's, the store's
// latency, the completer's and the cleaner's work, the Go runtime's and
// the process's. The receipts consumer is off (--consume=false): it
// applies the order's event through idem.Do on the same store, and its
// claim, at a moment the test does not choose, made the store's counts
// one more than the request's under load (a CI run, 2026-12-05).
func TestServeMetricFamilies(t *testing.T) {
	maddr := freeAddr(t)
	base, mbase, secret, _, _ := obsServe(t, nil, "--metrics-addr", maddr, "--consume=false")
	if got := obsPost(t, base, secret, "obs-user-ivan", "obs-key-m1"); got != http.StatusCreated {
		t.Fatalf("create: %d", got)
	}
	resp, err := http.Get(mbase + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	body := string(b)
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain; version=0.0.4") {
		t.Fatalf("metrics: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	for _, want := range []string{
		"# TYPE orders_created_total counter", "\norders_created_total 1\n",
		`orders_http_responses_total{code="201",route="POST /v1/orders"} 1`,
		"# TYPE orders_http_request_duration_seconds histogram",
		`orders_http_request_duration_seconds_count{route="POST /v1/orders"} 1`,
		"\nidem_executions_total 1\n", "\nidem_completed_total 1\n", "\nidem_fenced_total 0\n",
		"# TYPE idem_store_call_duration_seconds histogram",
		`idem_store_call_duration_seconds_count{operation="claim"} 1`,
		`idem_store_call_duration_seconds_count{operation="complete"} 1`,
		"\nidem_completer_scans_total ",
		`idem_completer_redriven_total{result="completed"} 0`,
		`orders_cleaner_deleted_total{store="orders"} 0`,
		`orders_cleaner_deleted_total{store="gateway"} 0`,
		`orders_cleaner_errors_total{store="orders"} 0`,
		"\ngo_goroutines ", "\nprocess_cpu_seconds_total ",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("/metrics:\n%s", body)
	}
	// Other methods and paths on --metrics-addr are problems.
	for _, c := range []struct {
		method, path string
		status       int
	}{{"POST", "/metrics", 405}, {"GET", "/metricz", 404}} {
		req, _ := http.NewRequest(c.method, mbase+c.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.status || resp.Header.Get("Content-Type") != "application/problem+json" {
			t.Errorf("%s %s: %d %s, want %d problem+json", c.method, c.path, resp.StatusCode, resp.Header.Get("Content-Type"), c.status)
		}
	}
}
