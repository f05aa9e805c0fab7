package everystore_test

// Benchmarks of issue 11, point 1: the default fingerprint (a small and a
// ~2 KB JSON body) and key parsing. The middleware on each store is
// benchmarked in the stores' packages (memstore, sqlitestore, pgstore,
// redisfront); see docs/BENCHMARKS.md.

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idem-go/idem"
)

// smallBody is a typical create request.
const smallBody = `{"sku":"sku_42","quantity":1,"currency":"EUR","note":"benchmark"}`

// largeBody returns a JSON body of about 2 KB: an order of 24 items with
// nested objects, numbers, booleans and escaped strings.
func largeBody() []byte {
	var b strings.Builder
	b.WriteString(`{"customer":{"id":"cus_0123456789","email":"a.b@example.com","name":"Zoë \"Z\" Example"},"currency":"EUR","items":[`)
	for i := range 24 {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"sku":"sku_%04d","quantity":%d,"price":%d.25,"gift":%t,"tags":["a","b"]}`, i, i+1, 100*i, i%2 == 0)
	}
	b.WriteString(`],"metadata":{"source":"benchmark","campaign":null},"total":12345}`)
	return []byte(b.String())
}

func benchFingerprint(b *testing.B, target string, body []byte) {
	r := httptest.NewRequest(http.MethodPost, target, nil)
	want, err := idem.Fingerprint(r, body)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		fp, err := idem.Fingerprint(r, body)
		if err != nil || fp != want {
			b.Fatalf("Fingerprint: %q, %v; want %q", fp, err, want)
		}
	}
}

// BenchmarkFingerprint is idem.Fingerprint of a small and a ~2 KB JSON
// body, of a 2 KB body that is not JSON (hashed as it is), and of the
// small body under a query of four parameters, out of order and escaped.
func BenchmarkFingerprint(b *testing.B) {
	large := largeBody()
	b.Run("small-json", func(b *testing.B) { benchFingerprint(b, "/v1/orders", []byte(smallBody)) })
	b.Run(fmt.Sprintf("json-%dB", len(large)), func(b *testing.B) { benchFingerprint(b, "/v1/orders", large) })
	b.Run("raw-2048B", func(b *testing.B) { benchFingerprint(b, "/v1/orders", []byte(strings.Repeat("x", 2048))) })
	b.Run("small-json-query", func(b *testing.B) {
		benchFingerprint(b, "/v1/orders?expand=customer&dry_run=true&note=a+b%2Fc&expand=items", []byte(smallBody))
	})
}

// BenchmarkParseKey is idem.ParseKey of a bare UUID key and of the same
// key as an RFC 8941 sf-string.
func BenchmarkParseKey(b *testing.B) {
	for _, c := range []struct{ name, v string }{
		{"bare-uuid", "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{"sf-string", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				k, err := idem.ParseKey(c.v)
				if err != nil || k != "8e03978e-40d5-43e8-bc93-6894a57f9324" {
					b.Fatalf("ParseKey(%q) = %q, %v", c.v, k, err)
				}
			}
		})
	}
}
