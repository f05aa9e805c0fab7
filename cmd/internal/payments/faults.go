package payments

import (
	"bytes"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
)

// dropAfterCharge injects Config.FailAfterCharge: for that fraction of
// first attempts of an idempotency key, the outcome is committed (the
// PaymentIntent exists and the key will replay it) but the connection is
// closed without an answer, the failure that makes a client retry a
// payment that was in fact made.
func (s *Server) dropAfterCharge(next http.Handler) http.Handler {
	if s.cfg.FailAfterCharge <= 0 {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		if key == "" {
			next.ServeHTTP(w, r)
			return
		}
		buf := newResponseBuffer()
		next.ServeHTTP(buf, r)
		status := buf.statusCode()
		committed := status == http.StatusOK || status == http.StatusPaymentRequired
		replayed := buf.header.Get("Idempotent-Replayed") == "true"
		if !committed || replayed || rand.Float64() >= s.cfg.FailAfterCharge {
			buf.writeTo(w)
			return
		}
		s.dropped.Add(1)
		s.cfg.Logger.InfoContext(r.Context(), "payments: fault injected: connection dropped after charge",
			"request_id", requestIDFrom(r.Context()), "idempotency_key", key, "status", status)
		conn, _, err := http.NewResponseController(w).Hijack()
		if err != nil {
			// HTTP/2, or a ResponseWriter that cannot be hijacked (the
			// in-process transport): net/http and InProcess both end the
			// exchange without an answer on this panic.
			panic(http.ErrAbortHandler)
		}
		conn.Close()
	})
}

// responseBuffer is an http.ResponseWriter that keeps the response in
// memory.
type responseBuffer struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func newResponseBuffer() *responseBuffer { return &responseBuffer{header: make(http.Header)} }

func (b *responseBuffer) Header() http.Header { return b.header }

func (b *responseBuffer) WriteHeader(status int) {
	if b.status == 0 && status >= 200 {
		b.status = status
	}
}

func (b *responseBuffer) Write(p []byte) (int, error) {
	if b.status == 0 {
		b.status = http.StatusOK
	}
	return b.body.Write(p)
}

func (b *responseBuffer) statusCode() int {
	if b.status == 0 {
		return http.StatusOK
	}
	return b.status
}

func (b *responseBuffer) writeTo(w http.ResponseWriter) {
	h := w.Header()
	for k, v := range b.header {
		h[k] = v
	}
	w.WriteHeader(b.statusCode())
	w.Write(b.body.Bytes())
}

// response returns the buffered response as a client sees it.
func (b *responseBuffer) response(req *http.Request) *http.Response {
	status := b.statusCode()
	h := b.header.Clone()
	h.Del("Content-Length")
	h.Set("Content-Length", strconv.Itoa(b.body.Len()))
	return &http.Response{
		Status:        strconv.Itoa(status) + " " + http.StatusText(status),
		StatusCode:    status,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Body:          io.NopCloser(bytes.NewReader(b.body.Bytes())),
		ContentLength: int64(b.body.Len()),
		Request:       req,
	}
}
