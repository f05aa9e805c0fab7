package idem_test

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/idem-go/idem"
)

// A retry whose path a proxy normalised (/v1/%74hings for /v1/things) is
// the same request: it is replayed, not refused with 422.
func TestRetryWithReencodedPathReplays(t *testing.T) {
	b := setup(t, idem.Options{}, created)
	first := b.post(t, "k", `{"a":1}`)
	req, err := http.NewRequest(http.MethodPost, b.srv.URL+"/v1/%74hings", strings.NewReader(`{"a":1}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", "k")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != first.status || string(body) != first.body || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("retry at /v1/%%74hings: %d %s replayed=%q; want the first answer replayed", resp.StatusCode, body, resp.Header.Get("Idempotent-Replayed"))
	}
	if got := b.runs.Load(); got != 1 {
		t.Errorf("runs = %d, want 1", got)
	}
}
