package idem

import (
	"net/http"
	"strings"
)

// recorder holds a handler's response until its outcome is committed: the
// client must never see an answer whose data was rolled back. It implements
// http.Flusher so handlers that flush keep working; a flush before the
// commit is deferred to it.
type recorder struct {
	header http.Header
	status int
	body   []byte // nil until bytes are written
	room   []byte // where the body starts, if not nil: spare room of the request's exchange
}

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
	if len(p) == 0 {
		return 0, nil // the body stays nil until bytes come
	}
	if r.body == nil {
		r.body = r.room[:0:len(r.room)]
	}
	r.body = append(r.body, p...)
	return len(p), nil
}

// Flush is deferred: the response is sent once the outcome is committed.
func (r *recorder) Flush() {}

func (r *recorder) statusCode() int {
	if r.status == 0 {
		return http.StatusOK
	}
	return r.status
}

// split parts the handler's header into the header proper and the
// trailers, as net/http would send them: the trailers are the names the
// Trailer header declares (those net/http accepts as trailers), and the
// keys set with http.TrailerPrefix, less its prefix. Neither the Trailer
// header nor the trailers are in header; trailer is nil without any.
// Without a Trailer header or a prefixed key, header is r.header itself.
func (r *recorder) split() (header, trailer http.Header) {
	plain := true
	for k := range r.header {
		if k == "Trailer" || strings.HasPrefix(k, http.TrailerPrefix) {
			plain = false
			break
		}
	}
	if plain {
		// Nothing to part: the header proper is the whole of it.
		return r.header, nil
	}
	declared := make(map[string]bool)
	for _, v := range r.header.Values("Trailer") {
		for _, n := range strings.Split(v, ",") {
			if n = http.CanonicalHeaderKey(strings.TrimSpace(n)); n != "" && validTrailer(n) {
				declared[n] = true
			}
		}
	}
	header = make(http.Header, len(r.header))
	for k, v := range r.header {
		switch name, prefixed := strings.CutPrefix(k, http.TrailerPrefix); {
		case prefixed:
			if trailer == nil {
				trailer = make(http.Header)
			}
			trailer[http.CanonicalHeaderKey(name)] = append(trailer[http.CanonicalHeaderKey(name)], v...)
		case declared[k]:
			if len(v) > 0 {
				if trailer == nil {
					trailer = make(http.Header)
				}
				trailer[k] = append(trailer[k], v...)
			}
		case k == "Trailer":
		default:
			header[k] = v
		}
	}
	return header, trailer
}

// validTrailer reports whether net/http sends the canonical name as a
// trailer (RFC 9110, section 6.5.1; httpguts.ValidTrailerHeader).
func validTrailer(name string) bool {
	switch name {
	case "Authorization", "Cache-Control", "Connection", "Content-Encoding", "Content-Length",
		"Content-Range", "Content-Type", "Expect", "Host", "Keep-Alive", "Max-Forwards", "Pragma",
		"Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection", "Range", "Realm", "Te",
		"Trailer", "Transfer-Encoding", "Www-Authenticate":
		return false
	}
	return !strings.HasPrefix(name, "If-")
}

// writeTo sends the held response to w, its trailers as trailers.
func (r *recorder) writeTo(w http.ResponseWriter) {
	header, trailer := r.split()
	r.writeSplit(w, header, trailer)
}

// writeSplit is writeTo with header and trailer what split returned.
func (r *recorder) writeSplit(w http.ResponseWriter, header, trailer http.Header) {
	dst := w.Header()
	for k, v := range header {
		dst[k] = v
	}
	writeWithTrailers(w, r.statusCode(), r.body, trailer)
}
