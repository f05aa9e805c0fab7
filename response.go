package idem

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/problem"
)

// replay writes a stored response with Idempotent-Replayed: true, its
// Content-Length from the body, and its trailers, if any, as trailers
// (declared in the Trailer header, without a Content-Length, so that
// HTTP/1.1 sends them after a chunked body). resp is the store's answer
// to this request's claim: a Response of its own (see Store.Claim), whose
// header and trailer values are handed to w as they are instead of
// copied, and the values the middleware sets are kept in x.
func (x *exchange) replay(w http.ResponseWriter, resp *idemdriver.Response) {
	h := w.Header()
	for k, v := range resp.Header {
		h[k] = v
	}
	x.header(h, 1, "Idempotent-Replayed", "true")
	if len(resp.Trailer) == 0 {
		x.header(h, 2, "Content-Length", strconv.Itoa(len(resp.Body)))
	}
	writeTrailers(w, resp.Status, resp.Body, resp.Trailer, false)
}

// writeWithTrailers writes status and body to w, whose header is set,
// then trailer as trailers, declared before the status.
func writeWithTrailers(w http.ResponseWriter, status int, body []byte, trailer http.Header) {
	writeTrailers(w, status, body, trailer, true)
}

// writeTrailers is writeWithTrailers; with copyValues false, the
// trailers' value slices are handed to w as they are.
func writeTrailers(w http.ResponseWriter, status int, body []byte, trailer http.Header, copyValues bool) {
	h := w.Header()
	if len(trailer) > 0 {
		names := slices.Sorted(maps.Keys(trailer))
		h.Set("Trailer", strings.Join(names, ", "))
	}
	w.WriteHeader(status)
	w.Write(body)
	for k, v := range trailer {
		if copyValues {
			v = append([]string(nil), v...)
		}
		h[k] = v
	}
}

// notStored is what is kept in place of resp when its body is over limit:
// the same status and kept headers (Location still names what was made),
// with a problem that says the answer was not kept.
func notStored(resp *idemdriver.Response, limit int64) *idemdriver.Response {
	p := problem.Details{
		Type:   problem.ResponseNotStored,
		Title:  "Answer too large to keep",
		Status: resp.Status,
		Detail: fmt.Sprintf("The request with this Idempotency-Key completed with status %d and its work was committed once; "+
			"its answer (%d bytes of body) was over the %d bytes kept for replay, or its headers held bytes no store keeps, "+
			"so only its status and Location are repeated here. "+
			"It will not run again.", resp.Status, len(resp.Body), limit),
		Extra: map[string]any{"original_status": resp.Status, "original_length": len(resp.Body)},
	}
	b, _ := json.Marshal(p) // problem details of plain values always encode
	// Only Location is kept, when it is of a sane size: the other headers
	// described the original body (or may be what made it too large), and
	// its trailers are left out with it.
	h := http.Header{"Content-Type": {"application/problem+json"}}
	if loc := resp.Header.Values("Location"); len(loc) > 0 && headerSize(http.Header{"Location": loc}) <= maxKeptLocation &&
		keepableHeaders(http.Header{"Location": loc}) {
		h["Location"] = append([]string(nil), loc...)
	}
	return &idemdriver.Response{Status: resp.Status, Header: h, Body: b}
}

// keepableHeaders reports whether every store can keep h exactly: no NUL
// (PostgreSQL's jsonb refuses it) and valid UTF-8 (JSON would replace the
// rest). An answer whose kept headers or trailers are not keepable is
// kept as an answer too large to keep is: the work is never run twice.
func keepableHeaders(h http.Header) bool {
	for k, vs := range h {
		if !keepableText(k) {
			return false
		}
		for _, v := range vs {
			if !keepableText(v) {
				return false
			}
		}
	}
	return true
}

func keepableText(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

// maxKeptLocation bounds the Location kept with an answer too large to keep.
const maxKeptLocation = 8 << 10

// storedSize is what keeping resp costs: its body, headers and trailers.
func storedSize(resp *idemdriver.Response) int64 {
	return int64(len(resp.Body)) + headerSize(resp.Header) + headerSize(resp.Trailer)
}

func headerSize(h http.Header) int64 {
	var n int64
	for k, vs := range h {
		for _, v := range vs {
			n += int64(len(k) + len(v) + 4) // "k: v\r\n"
		}
	}
	return n
}
