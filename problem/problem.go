// Package problem writes RFC 9457 problem details
// (application/problem+json) and names the problem types that the
// idempotency middleware (package idem) answers with.
//
// Every type URI begins with Base. The URIs are stable: clients may
// switch on them, and the README lists them. Services may name their own
// types under Base, as the order service does.
package problem

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// Base is the prefix of every problem type URI this module emits.
const Base = "https://idem-go.github.io/problems/"

// Problem type URIs used by the idempotency middleware.
const (
	KeyMissing       = Base + "idempotency-key-missing"
	KeyInvalid       = Base + "idempotency-key-invalid"
	KeyMismatch      = Base + "idempotency-key-mismatch"
	InFlight         = Base + "idempotency-key-in-flight"
	RequestTooLarge  = Base + "request-too-large"
	BadBody          = Base + "request-body-unreadable"
	BadTarget        = Base + "request-target-invalid"
	StoreUnavailable = Base + "idempotency-store-unavailable"
	Internal         = Base + "internal"
	// NotDue answers a completer's own re-drive (never a client's) whose
	// operation is over or not due.
	NotDue = Base + "redrive-not-due"
	// ResponseNotStored is replayed, with the original status, for a
	// request whose work committed but whose answer was over
	// idem.Options.MaxStoredBody; its "original_status" member names the
	// status.
	ResponseNotStored = Base + "response-not-stored"
)

// Details is an RFC 9457 problem details object.
type Details struct {
	Type     string `json:"type"`
	Title    string `json:"title"`
	Status   int    `json:"status"`
	Detail   string `json:"detail,omitempty"`
	Instance string `json:"instance,omitempty"`
	// Extra members are merged into the JSON object.
	Extra map[string]any `json:"-"`
}

// MarshalJSON writes the standard members followed by Extra.
func (p Details) MarshalJSON() ([]byte, error) {
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

// Write writes p as application/problem+json with p.Status, and removes
// any Location header set before.
func Write(w http.ResponseWriter, p Details) {
	b, err := json.Marshal(p)
	if err != nil {
		b = []byte(`{"type":"` + Internal + `","title":"Internal Server Error","status":500}`)
		p.Status = http.StatusInternalServerError
	}
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.Header().Del("Location")
	w.WriteHeader(p.Status)
	w.Write(b)
}
