package idemprom_test

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemotel"
	"github.com/idem-go/idem/idemprom"
	"github.com/idem-go/idem/memstore"
)

// BenchmarkWrapOverhead measures what the adapters add to a keyed request
// on the memory store, where the store costs least and the wrappers show
// most: bare, with idemprom's latency wrapper, with idemotel's spans on a
// no-op tracer (the order service without OTEL_EXPORTER_OTLP_ENDPOINT sets
// up neither: it wraps only when a collector is named), and with spans
// recorded by the SDK (sampled, no exporter). Compare the sub-benchmarks of
// one run: go test -run '^$' -bench WrapOverhead -benchmem ./idemprom
func BenchmarkWrapOverhead(b *testing.B) {
	wraps := []struct {
		name string
		wrap func(idem.Store) (idem.Store, func(http.Handler) http.Handler)
	}{
		{"bare", func(s idem.Store) (idem.Store, func(http.Handler) http.Handler) { return s, nil }},
		{"prom", func(s idem.Store) (idem.Store, func(http.Handler) http.Handler) {
			return idemprom.NewStoreMetrics().Wrap(s), nil
		}},
		{"prom+otel-noop", func(s idem.Store) (idem.Store, func(http.Handler) http.Handler) {
			o := idemotel.Options{TracerProvider: noop.NewTracerProvider()}
			return idemotel.WrapStore(idemprom.NewStoreMetrics().Wrap(s), o),
				func(h http.Handler) http.Handler { return idemotel.Handler(h, o) }
		}},
		{"prom+otel-sdk", func(s idem.Store) (idem.Store, func(http.Handler) http.Handler) {
			tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()))
			b.Cleanup(func() { tp.Shutdown(b.Context()) })
			o := idemotel.Options{TracerProvider: tp}
			return idemotel.WrapStore(idemprom.NewStoreMetrics().Wrap(s), o),
				func(h http.Handler) http.Handler { return idemotel.Handler(h, o) }
		}},
	}
	for _, mode := range []string{"create", "replay"} {
		for _, w := range wraps {
			b.Run(mode+"/"+w.name, func(b *testing.B) {
				store, inner := w.wrap(memstore.New(memstore.Options{}))
				var h http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					w.WriteHeader(http.StatusCreated)
					w.Write([]byte(`{"id":"o1"}`))
				})
				if inner != nil {
					h = inner(h)
				}
				h = idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(h)
				body := `{"items":[{"sku":"SKU-1","quantity":2}]}`
				send := func(key string) {
					req := httptest.NewRequest(http.MethodPost, "/v1/orders", strings.NewReader(body))
					req.Header.Set("Idempotency-Key", key)
					rec := httptest.NewRecorder()
					h.ServeHTTP(rec, req)
					if rec.Code != http.StatusCreated {
						b.Fatalf("status %d: %s", rec.Code, rec.Body)
					}
				}
				if mode == "replay" {
					send("k")
				}
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; b.Loop(); i++ {
					if mode == "create" {
						send("k" + strconv.Itoa(i))
					} else {
						send("k")
					}
				}
			})
		}
	}
}
