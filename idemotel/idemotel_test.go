package idemotel_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/idemotel"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/storetest"
)

func obsProvider(t *testing.T) (*sdktrace.TracerProvider, *tracetest.SpanRecorder) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { tp.Shutdown(context.Background()) })
	return tp, rec
}

// obsEnded returns the ended spans by name and forgets them.
func obsEnded(rec *tracetest.SpanRecorder) map[string][]sdktrace.ReadOnlySpan {
	out := map[string][]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		out[s.Name()] = append(out[s.Name()], s)
	}
	rec.Reset()
	return out
}

func obsAttr(s sdktrace.ReadOnlySpan, k attribute.Key) any {
	for _, kv := range s.Attributes() {
		if kv.Key == k {
			return kv.Value.AsInterface()
		}
	}
	return nil
}

// obsClean checks that nothing a span recorded (attributes, status,
// events) holds one of secrets.
func obsClean(t *testing.T, spans map[string][]sdktrace.ReadOnlySpan, secrets ...string) {
	t.Helper()
	for _, ss := range spans {
		for _, s := range ss {
			texts := []string{s.Status().Description}
			for _, kv := range s.Attributes() {
				texts = append(texts, kv.Value.String())
			}
			for _, e := range s.Events() {
				texts = append(texts, e.Name)
				for _, kv := range e.Attributes {
					texts = append(texts, kv.Value.String())
				}
			}
			for _, txt := range texts {
				for _, sec := range secrets {
					if strings.Contains(txt, sec) {
						t.Errorf("span %s records %q, which holds %q", s.Name(), txt, sec)
					}
				}
			}
		}
	}
}

// Through the middleware: a create makes claim (claimed), handler and
// complete (stored) spans; a replay a claim span (replayed) and no handler
// span; a repeat while the first runs a claim span (in_flight); a 4xx
// first attempt a release span, a 5xx a fail span. The transaction stays
// reachable by memstore.FromContext.
func TestMiddlewareSpans(t *testing.T) {
	tp, rec := obsProvider(t)
	opts := idemotel.Options{TracerProvider: tp}
	const user, key = "obs-user-frank", "obs-key-a8c1"
	st := idemotel.WrapStore(memstore.New(memstore.Options{}), opts)
	hold, entered := make(chan struct{}), make(chan struct{}, 1)
	h := idem.Middleware(st, idem.Options{User: func(*http.Request) string { return user }})(idemotel.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := memstore.FromContext(r.Context()); err != nil {
			t.Errorf("memstore.FromContext through the wrapper: %v", err)
		}
		switch r.URL.Path {
		case "/hold":
			entered <- struct{}{}
			<-hold
		case "/bad":
			w.WriteHeader(http.StatusBadRequest)
			return
		case "/down":
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{"secret":"obs-body-secret"}`))
	}), opts))
	do := func(path, key string) int {
		r := httptest.NewRequest("POST", path, strings.NewReader(`{"b":"obs-body-secret"}`))
		r.Header.Set("Idempotency-Key", key)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w.Code
	}
	secrets := []string{user, key, "obs-body-secret"}

	if c := do("/x", key); c != http.StatusCreated {
		t.Fatalf("create: %d", c)
	}
	spans := obsEnded(rec)
	obsClean(t, spans, secrets...)
	for _, n := range []string{idemotel.SpanClaim, idemotel.SpanBegin, idemotel.SpanHandler, idemotel.SpanComplete} {
		if len(spans[n]) != 1 {
			t.Fatalf("%d spans %s, want 1: %v", len(spans[n]), n, spans)
		}
	}
	if got := obsAttr(spans[idemotel.SpanClaim][0], idemotel.AttrOutcome); got != idemotel.OutcomeClaimed {
		t.Errorf("claim outcome %v", got)
	}
	if got := obsAttr(spans[idemotel.SpanClaim][0], idemotel.AttrAttempt); got != int64(1) {
		t.Errorf("claim attempt %v", got)
	}
	if got := obsAttr(spans[idemotel.SpanHandler][0], idemotel.AttrStatus); got != int64(201) {
		t.Errorf("handler status %v", got)
	}
	if got := obsAttr(spans[idemotel.SpanComplete][0], idemotel.AttrOutcome); got != idemotel.OutcomeStored {
		t.Errorf("complete outcome %v", got)
	}
	if got := obsAttr(spans[idemotel.SpanComplete][0], idemotel.AttrStatus); got != int64(201) {
		t.Errorf("complete status %v", got)
	}

	if c := do("/x", key); c != http.StatusCreated {
		t.Fatalf("replay: %d", c)
	}
	spans = obsEnded(rec)
	obsClean(t, spans, secrets...)
	if len(spans[idemotel.SpanClaim]) != 1 || obsAttr(spans[idemotel.SpanClaim][0], idemotel.AttrOutcome) != idemotel.OutcomeReplayed ||
		obsAttr(spans[idemotel.SpanClaim][0], idemotel.AttrStatus) != int64(201) {
		t.Errorf("replay claim spans: %v", spans[idemotel.SpanClaim])
	}
	if len(spans[idemotel.SpanHandler]) != 0 || len(spans[idemotel.SpanComplete]) != 0 {
		t.Errorf("a replay ran the handler or completed: %v", spans)
	}

	// In flight.
	done := make(chan int, 1)
	go func() { done <- do("/hold", "obs-key-held") }()
	<-entered
	obsEnded(rec)
	if c := do("/hold", "obs-key-held"); c != http.StatusConflict {
		t.Errorf("repeat in flight: %d", c)
	}
	spans = obsEnded(rec)
	if len(spans[idemotel.SpanClaim]) != 1 || obsAttr(spans[idemotel.SpanClaim][0], idemotel.AttrOutcome) != idemotel.OutcomeInFlight {
		t.Errorf("in-flight claim spans: %v", spans)
	}
	close(hold)
	if c := <-done; c != http.StatusCreated {
		t.Errorf("held request: %d", c)
	}

	// Mismatch: the same key, another path.
	obsEnded(rec)
	if c := do("/y", key); c != http.StatusUnprocessableEntity {
		t.Errorf("mismatch: %d", c)
	}
	if spans = obsEnded(rec); len(spans[idemotel.SpanClaim]) != 1 || obsAttr(spans[idemotel.SpanClaim][0], idemotel.AttrOutcome) != idemotel.OutcomeMismatch {
		t.Errorf("mismatch claim spans: %v", spans)
	}

	// Released, failed.
	if c := do("/bad", "obs-key-bad"); c != http.StatusBadRequest {
		t.Errorf("bad: %d", c)
	}
	if spans = obsEnded(rec); len(spans[idemotel.SpanRelease]) != 1 || obsAttr(spans[idemotel.SpanRelease][0], idemotel.AttrOutcome) != idemotel.OutcomeReleased {
		t.Errorf("release spans: %v", spans)
	}
	if c := do("/down", "obs-key-down"); c != http.StatusServiceUnavailable {
		t.Errorf("down: %d", c)
	}
	spans = obsEnded(rec)
	if len(spans[idemotel.SpanFail]) != 1 || obsAttr(spans[idemotel.SpanFail][0], idemotel.AttrOutcome) != idemotel.OutcomeFailed {
		t.Errorf("fail spans: %v", spans)
	}
	if len(spans[idemotel.SpanHandler]) != 1 || spans[idemotel.SpanHandler][0].Status().Code != codes.Error {
		t.Errorf("the handler span of a 503 is not an error: %v", spans[idemotel.SpanHandler])
	}
}

// A completion or a fail after a takeover is fenced; a store error is an
// error outcome with its type, and its text (which may quote the key) is
// recorded nowhere.
func TestStoreSpanOutcomes(t *testing.T) {
	tp, rec := obsProvider(t)
	clock := storetest.NewClock(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC))
	mem := memstore.New(memstore.Options{Now: clock.Now})
	st := idemotel.WrapStore(mem, idemotel.Options{TracerProvider: tp})
	if _, ok := st.(idemdriver.Sweeper); !ok {
		t.Error("the wrapper of memstore is not a Sweeper")
	}
	if _, ok := idemotel.WrapStore(struct{ idem.Store }{mem}, idemotel.Options{TracerProvider: tp}).(idemdriver.Sweeper); ok {
		t.Error("the wrapper of a store without Sweeper is a Sweeper")
	}
	ctx := context.Background()
	p := idemdriver.ClaimParams{User: "obs-user-gina", Key: "obs-key-77", Fingerprint: "f", Owner: idemdriver.NewOwner(), Lease: time.Second}
	c1, err := st.Claim(ctx, p)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := st.Begin(ctx, c1.Lease)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := idemdriver.UnwrapTx(tx).(*memstore.Tx); !ok {
		t.Errorf("UnwrapTx gives %T, want *memstore.Tx", idemdriver.UnwrapTx(tx))
	}
	clock.Advance(2 * time.Second)
	p.Owner = idemdriver.NewOwner()
	c2, err := st.Claim(ctx, p)
	if err != nil || c2.Lease == nil {
		t.Fatalf("takeover: %+v %v", c2, err)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{Status: 201}); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("fenced complete: %v", err)
	}
	if err := st.Fail(ctx, c1.Lease); !errors.Is(err, idem.ErrFenced) {
		t.Fatalf("fenced fail: %v", err)
	}
	spans := obsEnded(rec)
	if got := obsAttr(spans[idemotel.SpanClaim][1], idemotel.AttrAttempt); got != int64(2) {
		t.Errorf("takeover attempt %v, want 2", got)
	}
	if got := obsAttr(spans[idemotel.SpanComplete][0], idemotel.AttrOutcome); got != idemotel.OutcomeFenced {
		t.Errorf("complete outcome %v, want fenced", got)
	}
	if got := obsAttr(spans[idemotel.SpanFail][0], idemotel.AttrOutcome); got != idemotel.OutcomeFenced {
		t.Errorf("fail outcome %v, want fenced", got)
	}

	bad := idemotel.WrapStore(brokenStore{mem}, idemotel.Options{TracerProvider: tp})
	if _, err := bad.Claim(ctx, idemdriver.ClaimParams{User: "obs-user-gina", Key: "obs-key-quoted"}); err == nil {
		t.Fatal("no error")
	}
	spans = obsEnded(rec)
	obsClean(t, spans, "obs-key-quoted", "obs-user-gina")
	s := spans[idemotel.SpanClaim][0]
	if obsAttr(s, idemotel.AttrOutcome) != idemotel.OutcomeError || obsAttr(s, idemotel.AttrErrorType) != "*idemotel_test.keyError" || s.Status().Code != codes.Error {
		t.Errorf("error claim span: %v %v", s.Attributes(), s.Status())
	}
}

type keyError struct{ key string }

func (e *keyError) Error() string { return "duplicate key " + e.key }

type brokenStore struct{ idem.Store }

func (brokenStore) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	return idemdriver.Claim{}, &keyError{p.User + "/" + p.Key}
}

// Log records made with a context that holds a span carry its ids.
func TestLogHandlerAddsTraceIDs(t *testing.T) {
	tp, _ := obsProvider(t)
	var buf bytes.Buffer
	log := slog.New(idemotel.LogHandler(slog.NewTextHandler(&buf, nil))).With("svc", "x")
	ctx, span := tp.Tracer("t").Start(context.Background(), "s")
	log.InfoContext(ctx, "inside")
	span.End()
	log.InfoContext(context.Background(), "outside")
	log.Info("no context")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("lines: %q", lines)
	}
	sc := span.SpanContext()
	if !strings.Contains(lines[0], "trace_id="+sc.TraceID().String()) || !strings.Contains(lines[0], "span_id="+sc.SpanID().String()) || !strings.Contains(lines[0], "svc=x") {
		t.Errorf("inside a span: %s", lines[0])
	}
	for _, l := range lines[1:] {
		if strings.Contains(l, "trace_id") {
			t.Errorf("outside a span: %s", l)
		}
	}
}
