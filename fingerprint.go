package idem

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
)

// Fingerprint returns the hex sha256 of the request's method, path and body.
// A body that is one valid JSON value is canonicalized first, so key order
// and white space do not matter; any other body is hashed as it is.
func Fingerprint(r *http.Request, body []byte) string {
	h := sha256.New()
	io.WriteString(h, r.Method)
	h.Write([]byte{0})
	io.WriteString(h, r.URL.EscapedPath())
	h.Write([]byte{0})
	if c, ok := CanonicalJSON(body); ok {
		h.Write([]byte{'j'})
		h.Write(c)
	} else {
		h.Write([]byte{'r'})
		h.Write(body)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// CanonicalJSON re-encodes one JSON value with object keys sorted and no
// insignificant white space. Numbers keep their literal spelling. It reports
// false if b is not exactly one JSON value.
func CanonicalJSON(b []byte) ([]byte, bool) {
	if len(bytes.TrimSpace(b)) == 0 {
		return nil, false
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, false
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, false
	}
	// encoding/json sorts map keys, which is all canonical form needs here.
	out, err := json.Marshal(v)
	if err != nil {
		return nil, false
	}
	return out, true
}
