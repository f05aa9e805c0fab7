// Package idemotel traces keyed requests with OpenTelemetry
// (go.opentelemetry.io/otel): spans around the claim of an
// Idempotency-Key, the handler, and the completion, with the key's outcome
// as attributes. The idem package itself depends on no tracing library;
// this package is the glue:
//
//   - WrapStore: a Store wrapper whose calls make the spans idem.claim,
//     idem.begin, idem.complete, idem.release and idem.fail.
//   - Handler: the span idem.handler around the handler the middleware
//     runs under a claimed key (wrap the handler given to idem.Middleware).
//   - LogHandler: a slog.Handler that adds the trace and span ids of the
//     record's context to log records.
//
// The spans carry the outcome (AttrOutcome: claimed, replayed, in_flight,
// mismatch, not_due, stored, fenced, released, failed, error), the attempt
// number, the operation id (idemdriver.OperationID: a hash, not the key) and HTTP
// statuses; never the key, the user or a body. A store error is recorded as
// its type (error.type) and the span's status, never its text, which may
// quote the key.
//
//	store = idemotel.WrapStore(store, idemotel.Options{TracerProvider: tp})
//	h := idem.Middleware(store, opts)(idemotel.Handler(handler, idemotel.Options{TracerProvider: tp}))
package idemotel

import (
	"fmt"
	"net/http"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

// ScopeName is the instrumentation scope of the tracer the spans are made with.
const ScopeName = "github.com/idem-go/idem/idemotel"

// Span names.
const (
	SpanClaim    = "idem.claim"
	SpanBegin    = "idem.begin"
	SpanComplete = "idem.complete"
	SpanRelease  = "idem.release"
	SpanFail     = "idem.fail"
	SpanHandler  = "idem.handler"
)

// Attribute keys.
const (
	// AttrOutcome is what a store call decided for the key:
	//   idem.claim:    claimed (this attempt runs), replayed (a stored
	//                  answer), in_flight (another attempt holds the key),
	//                  mismatch (the key was used for another request),
	//                  not_due (a completer's re-drive no longer due)
	//   idem.complete: stored (the outcome committed), deleted (committed,
	//                  key freed), fenced (the lease was lost: rolled back)
	//   idem.release:  released (the key is free again), fenced
	//   idem.fail:     failed (the attempt ended, the key kept for a
	//                  retry), fenced
	//   any:           error (the call failed)
	AttrOutcome = attribute.Key("idem.outcome")
	// AttrAttempt is the attempt number of the lease (1 for the first).
	AttrAttempt = attribute.Key("idem.attempt")
	// AttrOperation is idemdriver.OperationID of the lease: 16 hex characters
	// of a hash that names the operation in logs too, never the key.
	AttrOperation = attribute.Key("idem.operation_id")
	// AttrRedrive is true on the claims of a completer's re-drive.
	AttrRedrive = attribute.Key("idem.redrive")
	// AttrStatus is the HTTP status: of the replayed answer (idem.claim),
	// of the stored one (idem.complete), of the handler's (idem.handler).
	AttrStatus = attribute.Key("http.response.status_code")
	// AttrErrorType is the Go type of a store error (its text is never
	// recorded: it may quote the key).
	AttrErrorType = attribute.Key("error.type")
)

// Outcomes, the values of AttrOutcome.
const (
	OutcomeClaimed  = "claimed"
	OutcomeReplayed = "replayed"
	OutcomeInFlight = "in_flight"
	OutcomeMismatch = "mismatch"
	OutcomeNotDue   = "not_due"
	OutcomeStored   = "stored"
	OutcomeDeleted  = "deleted"
	OutcomeFenced   = "fenced"
	OutcomeReleased = "released"
	OutcomeFailed   = "failed"
	OutcomeError    = "error"
)

// Options configures WrapStore and Handler.
type Options struct {
	// TracerProvider makes the tracer. Default otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
}

func (o Options) tracer() trace.Tracer {
	tp := o.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(ScopeName)
}

// endErr ends span after a call that returned err, classified by known
// (the protocol's answers, which are outcomes and not errors), else as
// OutcomeError with the error's type.
func endErr(span trace.Span, err error, ok string, known ...knownErr) {
	switch {
	case err == nil:
		span.SetAttributes(AttrOutcome.String(ok))
	default:
		for _, k := range known {
			if isErr(err, k.err) {
				span.SetAttributes(AttrOutcome.String(k.outcome))
				span.End()
				return
			}
		}
		span.SetAttributes(AttrOutcome.String(OutcomeError), AttrErrorType.String(fmt.Sprintf("%T", err)))
		span.SetStatus(codes.Error, "store call failed")
	}
	span.End()
}

type knownErr struct {
	err     error
	outcome string
}

var fenced = knownErr{idem.ErrFenced, OutcomeFenced}

// leaseAttrs are the attributes of a lease: its attempt and operation.
func leaseAttrs(l *idemdriver.Lease) []attribute.KeyValue {
	if l == nil {
		return nil
	}
	return []attribute.KeyValue{AttrAttempt.Int(l.Attempt), AttrOperation.String(idemdriver.OperationID(l.User, l.Key, l.CreatedAt))}
}

// Handler returns next with the span idem.handler around it, a child of
// the request's context's span, with the lease's attempt and operation id
// (when the middleware claimed a key) and the status next answered; a
// 5xx or a panic sets the span's status to Error. Wrap the handler given
// to idem.Middleware with it, so that it runs under the claimed key: a
// replay or a refusal then makes no handler span.
func Handler(next http.Handler, opts Options) http.Handler {
	tr := opts.tracer()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, span := tr.Start(r.Context(), SpanHandler)
		if !span.IsRecording() {
			span.End()
			next.ServeHTTP(w, r)
			return
		}
		if l, ok := idem.LeaseFromContext(ctx); ok {
			span.SetAttributes(leaseAttrs(l)...)
		}
		sw := &statusWriter{ResponseWriter: w}
		defer func() {
			if v := recover(); v != nil {
				span.SetStatus(codes.Error, "handler panicked")
				span.End()
				panic(v)
			}
			code := sw.code
			if code == 0 {
				code = http.StatusOK
			}
			span.SetAttributes(AttrStatus.Int(code))
			if code >= 500 {
				span.SetStatus(codes.Error, http.StatusText(code))
			}
			span.End()
		}()
		next.ServeHTTP(sw, r.WithContext(ctx))
	})
}

// statusWriter remembers the status of an answer.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.code == 0 && code >= 200 {
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
