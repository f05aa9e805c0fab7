package idem_test

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

// TestStoredRequestBody: while a request runs, its key keeps the body the
// completer would run it again with: a JSON body without the white space
// a client padded it with (before, the whole padded body, up to
// MaxRequestBody, was kept), any other body as it came; the handler itself
// reads the body as sent. Once the answer is stored the body is dropped,
// and a retry with the padded body still replays.
func TestStoredRequestBody(t *testing.T) {
	ms := memstore.New(memstore.Options{})
	var kept, seen []string
	b := setupStore(t, ms, nil, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			t.Error(err)
		}
		seen = append(seen, string(body))
		rec, err := ms.Get(context.Background(), r.Header.Get("X-User"), r.Header.Get("Idempotency-Key"))
		if err != nil {
			t.Errorf("Get while running: %v", err)
		} else {
			kept = append(kept, string(rec.Body))
		}
		w.WriteHeader(http.StatusCreated)
	})
	padded := "{ \"a\" :\t1 ,\n\"b\": \"x y\"" + strings.Repeat(" ", 100000) + "}"
	if r := b.post(t, "k-json", padded, "X-User", "u"); r.status != http.StatusCreated {
		t.Fatalf("padded JSON: %d", r.status)
	}
	form := "a=1 &b=2"
	if r := b.post(t, "k-form", form, "X-User", "u", "Content-Type", "application/x-www-form-urlencoded"); r.status != http.StatusCreated {
		t.Fatalf("form: %d", r.status)
	}
	if len(kept) != 2 || kept[0] != `{"a":1,"b":"x y"}` || kept[1] != form {
		t.Errorf("kept while running: %q, want the compact JSON and the form as sent", kept)
	}
	if len(seen) != 2 || seen[0] != padded || seen[1] != form {
		t.Errorf("the handler read %d bodies, the first %d bytes; want the bodies as sent", len(seen), len(seen[0]))
	}
	for _, k := range []string{"k-json", "k-form"} {
		rec, err := ms.Get(context.Background(), "u", k)
		if err != nil || rec.Response == nil || len(rec.Body) != 0 {
			t.Errorf("%s once completed: %v, answer %v, body %d bytes; want the answer and no body", k, err, rec != nil && rec.Response != nil, len(rec.Body))
		}
	}
	if r := b.post(t, "k-json", padded, "X-User", "u"); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("retry of the padded body: %d replayed=%q", r.status, r.header.Get("Idempotent-Replayed"))
	}
}
