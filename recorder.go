package idem

import (
	"bytes"
	"net/http"
)

// recorder holds a handler's response until its outcome is committed: the
// client must never see an answer whose data was rolled back. It implements
// http.Flusher so handlers that flush keep working; a flush before the
// commit is deferred to it.
type recorder struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func newRecorder() *recorder { return &recorder{header: make(http.Header)} }

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(status int) {
	if r.status == 0 && status >= 200 {
		r.status = status
	}
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.status == 0 {
		r.status = http.StatusOK
	}
	return r.body.Write(p)
}

// Flush is deferred: the response is sent once the outcome is committed.
func (r *recorder) Flush() {}

func (r *recorder) statusCode() int {
	if r.status == 0 {
		return http.StatusOK
	}
	return r.status
}

// writeTo sends the held response to w.
func (r *recorder) writeTo(w http.ResponseWriter) {
	dst := w.Header()
	for k, v := range r.header {
		dst[k] = v
	}
	w.WriteHeader(r.statusCode())
	w.Write(r.body.Bytes())
}
