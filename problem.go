package idem

import (
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
)

// ProblemBase is the prefix of every problem type URI this module emits.
// The URIs are stable; the README lists them.
const ProblemBase = "https://idem-go.github.io/problems/"

// Problem type URIs used by the middleware.
const (
	ProblemKeyMissing       = ProblemBase + "idempotency-key-missing"
	ProblemKeyInvalid       = ProblemBase + "idempotency-key-invalid"
	ProblemKeyMismatch      = ProblemBase + "idempotency-key-mismatch"
	ProblemInFlight         = ProblemBase + "idempotency-key-in-flight"
	ProblemRequestTooLarge  = ProblemBase + "request-too-large"
	ProblemBadBody          = ProblemBase + "request-body-unreadable"
	ProblemBadTarget        = ProblemBase + "request-target-invalid"
	ProblemStoreUnavailable = ProblemBase + "idempotency-store-unavailable"
	ProblemInternal         = ProblemBase + "internal"
	// ProblemNotDue answers a completer's own re-drive (never a client's)
	// whose operation is over or not due.
	ProblemNotDue = ProblemBase + "redrive-not-due"
	// ProblemResponseNotStored is replayed, with the original status, for
	// a request whose work committed but whose answer was over
	// Options.MaxStoredBody; its "original_status" member names the status.
	ProblemResponseNotStored = ProblemBase + "response-not-stored"
)

// Problem is an RFC 9457 problem details object.
type Problem struct {
	Type     string `json:"type"`
	Title    string `json:"title"`
	Status   int    `json:"status"`
	Detail   string `json:"detail,omitempty"`
	Instance string `json:"instance,omitempty"`
	// Extra members are merged into the JSON object.
	Extra map[string]any `json:"-"`
}

// MarshalJSON writes the standard members followed by Extra.
func (p Problem) MarshalJSON() ([]byte, error) {
	m := make(map[string]any, len(p.Extra)+5)
	for k, v := range p.Extra {
		m[k] = v
	}
	m["type"], m["title"], m["status"] = p.Type, p.Title, p.Status
	if p.Detail != "" {
		m["detail"] = p.Detail
	}
	if p.Instance != "" {
		m["instance"] = p.Instance
	}
	return json.Marshal(m)
}

// WriteProblem writes p as application/problem+json with p.Status.
func WriteProblem(w http.ResponseWriter, p Problem) {
	b, err := json.Marshal(p)
	if err != nil {
		b = []byte(`{"type":"` + ProblemInternal + `","title":"Internal Server Error","status":500}`)
		p.Status = http.StatusInternalServerError
	}
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.Header().Del("Location")
	w.WriteHeader(p.Status)
	w.Write(b)
}

// ProblemFor maps the middleware's errors to problem details.
func ProblemFor(err error) Problem {
	switch {
	case errors.Is(err, ErrKeyMissing):
		return Problem{Type: ProblemKeyMissing, Title: "Idempotency-Key required", Status: http.StatusBadRequest, Detail: "This request must carry an Idempotency-Key header."}
	case errors.Is(err, ErrKeyInvalid):
		return Problem{Type: ProblemKeyInvalid, Title: "Invalid Idempotency-Key", Status: http.StatusBadRequest, Detail: err.Error()}
	case errors.Is(err, ErrFingerprintMismatch):
		return Problem{Type: ProblemKeyMismatch, Title: "Idempotency-Key reused with a different request", Status: http.StatusUnprocessableEntity, Detail: "This key was first used with another method, path or body; use a new key for a new request."}
	case errors.Is(err, ErrInFlight), errors.Is(err, ErrFenced):
		return Problem{Type: ProblemInFlight, Title: "Request with this Idempotency-Key in flight", Status: http.StatusConflict, Detail: "Another request with this key is still being processed; retry later with the same key."}
	case errors.Is(err, ErrBadTarget):
		return Problem{Type: ProblemBadTarget, Title: "Request target invalid", Status: http.StatusBadRequest, Detail: "The path or query holds bytes that are not UTF-8; percent-encode them."}
	case errors.Is(err, ErrBadBody):
		return Problem{Type: ProblemBadBody, Title: "Request body unreadable", Status: http.StatusBadRequest, Detail: err.Error()}
	case errors.Is(err, ErrRequestTooLarge):
		return Problem{Type: ProblemRequestTooLarge, Title: "Request body too large", Status: http.StatusRequestEntityTooLarge, Detail: err.Error()}
	case errors.Is(err, ErrNotDue):
		return Problem{Type: ProblemNotDue, Title: "Re-drive not due", Status: http.StatusPreconditionFailed, Detail: "The completer's re-drive found its operation answered, replaced, gone, or not due yet; nothing was run."}
	case errors.Is(err, ErrStoreUnavailable):
		return Problem{Type: ProblemStoreUnavailable, Title: "Idempotency store unavailable", Status: http.StatusServiceUnavailable, Detail: "The request was not run; retry with the same key."}
	default:
		return Problem{Type: ProblemInternal, Title: "Internal Server Error", Status: http.StatusInternalServerError, Detail: "The request failed; nothing was stored, and the same request may be retried with the same key."}
	}
}
