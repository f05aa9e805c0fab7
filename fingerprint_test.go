package idem

import (
	"net/http/httptest"
	"testing"
)

func TestFingerprint(t *testing.T) {
	fp := func(method, target, body string) string {
		return Fingerprint(httptest.NewRequest(method, target, nil), []byte(body))
	}
	base := fp("POST", "/v1/orders", `{"a":1,"b":[1,2],"c":{"x":"y","w":null}}`)
	same := []struct{ name, method, target, body string }{
		{"key order", "POST", "/v1/orders", `{"c":{"w":null,"x":"y"},"b":[1,2],"a":1}`},
		{"white space", "POST", "/v1/orders", " {\n\"a\" : 1, \"b\":[ 1 ,2 ],\"c\":{\"x\":\"y\",\"w\":null}}\n"},
		{"query string", "POST", "/v1/orders?x=1", `{"a":1,"b":[1,2],"c":{"x":"y","w":null}}`},
	}
	for _, tt := range same {
		if got := fp(tt.method, tt.target, tt.body); got != base {
			t.Errorf("%s: fingerprint differs, want equal", tt.name)
		}
	}
	differ := []struct{ name, method, target, body string }{
		{"method", "PUT", "/v1/orders", `{"a":1,"b":[1,2],"c":{"x":"y","w":null}}`},
		{"path", "POST", "/v1/other", `{"a":1,"b":[1,2],"c":{"x":"y","w":null}}`},
		{"value", "POST", "/v1/orders", `{"a":2,"b":[1,2],"c":{"x":"y","w":null}}`},
		{"array order", "POST", "/v1/orders", `{"a":1,"b":[2,1],"c":{"x":"y","w":null}}`},
		{"number spelling", "POST", "/v1/orders", `{"a":1.0,"b":[1,2],"c":{"x":"y","w":null}}`},
	}
	for _, tt := range differ {
		if got := fp(tt.method, tt.target, tt.body); got == base {
			t.Errorf("%s: fingerprint equal, want different", tt.name)
		}
	}
	if fp("POST", "/x", `{"a":1} {"b":2}`) == fp("POST", "/x", `{"a":1}`) {
		t.Errorf("trailing JSON value ignored")
	}
	if fp("POST", "/x", "not json") == fp("POST", "/x", "not  json") {
		t.Errorf("raw bodies that differ have one fingerprint")
	}
	if len(base) != 64 {
		t.Errorf("len(fingerprint) = %d, want 64 hex digits", len(base))
	}
}
