package problem_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/idem-go/idem/problem"
)

// TestWrite: Write answers application/problem+json with the
// status, a Content-Length, no Location, and the members, Extra merged in
// without overriding the standard ones.
func TestWrite(t *testing.T) {
	w := httptest.NewRecorder()
	w.Header().Set("Location", "/v1/orders/1")
	problem.Write(w, problem.Details{Type: problem.InFlight, Title: "t", Status: http.StatusConflict, Detail: "d",
		Extra: map[string]any{"status": 200, "original_status": 201}})
	if w.Code != http.StatusConflict || w.Header().Get("Content-Type") != "application/problem+json" ||
		w.Header().Get("Location") != "" || w.Header().Get("Content-Length") != strconv.Itoa(w.Body.Len()) {
		t.Fatalf("%d %v", w.Code, w.Header())
	}
	var got map[string]any
	if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"type": problem.InFlight, "title": "t", "status": 409.0, "detail": "d", "original_status": 201.0}
	if len(got) != len(want) {
		t.Fatalf("members %v; want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v; want %v", k, got[k], v)
		}
	}
}

// TestTypeURIs: the type URIs are the stable ones the README
// and the contract list.
func TestTypeURIs(t *testing.T) {
	for uri, name := range map[string]string{
		problem.KeyMissing: "idempotency-key-missing", problem.KeyInvalid: "idempotency-key-invalid",
		problem.KeyMismatch: "idempotency-key-mismatch", problem.InFlight: "idempotency-key-in-flight",
		problem.RequestTooLarge: "request-too-large", problem.BadBody: "request-body-unreadable",
		problem.BadTarget: "request-target-invalid", problem.StoreUnavailable: "idempotency-store-unavailable",
		problem.Internal: "internal", problem.NotDue: "redrive-not-due", problem.ResponseNotStored: "response-not-stored",
	} {
		if want := "https://idem-go.github.io/problems/" + name; uri != want || !strings.HasPrefix(uri, problem.Base) {
			t.Errorf("%s; want %s", uri, want)
		}
	}
}
