package idemconnect

import (
	"net/http"
	"strings"
)

// TrailersOnly wraps a Connect handler (generated code's New…Handler, on
// net/http) so that a gRPC-protocol call answered with an error before
// any message gets a Trailers-Only response: the status and the error's
// metadata in the one HEADERS frame that ends the stream.
//
// grpc-go's retry policy retries only such answers: an answer whose
// headers came in a frame of their own is committed, whatever its code.
// connect-go sends a gRPC error's status as HTTP trailers, which
// net/http writes after a HEADERS frame of their own, so without this
// wrapper the Aborted answer to a call whose key is in flight (and every
// other error) reaches a grpc-go client as committed and is never
// retried by its policy; with it, a client whose retryPolicy lists
// ABORTED retries with the same key until the first call's answer
// replays. Calls of the Connect and gRPC-Web protocols, and answers that
// sent a message, pass through untouched.
//
// It holds back the response's header until the handler writes a
// message, flushes the header alone (a stream's Send(nil)) or returns;
// at return, with nothing written, the trailers become headers.
func TrailersOnly(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !isGRPC(r.Header.Get("Content-Type")) || r.ProtoMajor < 2 {
			h.ServeHTTP(w, r)
			return
		}
		tw := &trailersOnlyWriter{w: w}
		h.ServeHTTP(tw, r)
		tw.finish() // not on a panic: net/http resets the stream
	})
}

// isGRPC reports whether a request's Content-Type is the gRPC protocol's
// (application/grpc, application/grpc+proto, …), not gRPC-Web's.
func isGRPC(ct string) bool {
	if i := strings.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	ct = strings.ToLower(strings.TrimSpace(ct))
	return ct == "application/grpc" || strings.HasPrefix(ct, "application/grpc+")
}

// trailersOnlyWriter holds back WriteHeader until the first Write (or a
// Flush before the trailers are set), and at finish, if neither came,
// turns the trailers declared with http.TrailerPrefix into headers.
type trailersOnlyWriter struct {
	w       http.ResponseWriter
	status  int  // held back
	started bool // the header went to w
}

func (t *trailersOnlyWriter) Header() http.Header { return t.w.Header() }

func (t *trailersOnlyWriter) WriteHeader(code int) {
	if t.started {
		t.w.WriteHeader(code) // net/http says what it makes of it
		return
	}
	if t.status == 0 {
		t.status = code
	}
}

func (t *trailersOnlyWriter) Write(p []byte) (int, error) {
	t.start()
	return t.w.Write(p)
}

// Flush before any message flushes nothing once the trailers are set
// (http.TrailerPrefix): connect-go flushes as it ends every call, after
// setting them, so a flush of the header then would make every error
// committed. A flush before that is a stream's header sent alone
// (connect-go's Send(nil)), which the client may be waiting for before
// it sends: it goes out at once.
func (t *trailersOnlyWriter) Flush() {
	if !t.started {
		if hasTrailers(t.w.Header()) {
			return
		}
		t.start()
	}
	if f, ok := t.w.(http.Flusher); ok {
		f.Flush()
	}
}

// hasTrailers reports whether h sets a trailer with http.TrailerPrefix.
func hasTrailers(h http.Header) bool {
	for k := range h {
		if strings.HasPrefix(k, http.TrailerPrefix) {
			return true
		}
	}
	return false
}

// Unwrap lets http.ResponseController reach w's other methods.
func (t *trailersOnlyWriter) Unwrap() http.ResponseWriter { return t.w }

func (t *trailersOnlyWriter) start() {
	if t.started {
		return
	}
	t.started = true
	if t.status != 0 {
		t.w.WriteHeader(t.status)
	}
}

// finish ends a response that sent nothing: its trailers, as headers,
// with the held-back status, so that net/http writes one HEADERS frame
// with END_STREAM.
func (t *trailersOnlyWriter) finish() {
	if t.started {
		return
	}
	h := t.w.Header()
	delete(h, "Trailer") // declared trailers are set as headers below
	for k, vs := range h {
		if name, ok := strings.CutPrefix(k, http.TrailerPrefix); ok {
			delete(h, k)
			name = http.CanonicalHeaderKey(name)
			h[name] = append(h[name], vs...)
		}
	}
	t.start()
}
