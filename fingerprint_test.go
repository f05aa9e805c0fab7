package idem

import (
	"errors"
	"net/http/httptest"
	"testing"
)

func TestFingerprint(t *testing.T) {
	fp := func(method, target, body string) string {
		t.Helper()
		s, err := Fingerprint(httptest.NewRequest(method, target, nil), []byte(body))
		if err != nil {
			t.Fatalf("Fingerprint(%s): %v", body, err)
		}
		return s
	}
	base := fp("POST", "/v1/orders", `{"a":1,"b":[1,2],"c":{"x":"y","w":null}}`)
	same := []struct{ name, method, target, body string }{
		{"key order", "POST", "/v1/orders", `{"c":{"w":null,"x":"y"},"b":[1,2],"a":1}`},
		{"white space", "POST", "/v1/orders", " {\n\"a\" : 1, \"b\":[ 1 ,2 ],\"c\":{\"x\":\"y\",\"w\":null}}\n"},
		{"empty query", "POST", "/v1/orders?", `{"a":1,"b":[1,2],"c":{"x":"y","w":null}}`},
	}
	for _, tt := range same {
		if got := fp(tt.method, tt.target, tt.body); got != base {
			t.Errorf("%s: fingerprint differs, want equal", tt.name)
		}
	}
	differ := []struct{ name, method, target, body string }{
		{"method", "PUT", "/v1/orders", `{"a":1,"b":[1,2],"c":{"x":"y","w":null}}`},
		{"path", "POST", "/v1/other", `{"a":1,"b":[1,2],"c":{"x":"y","w":null}}`},
		{"query string", "POST", "/v1/orders?x=1", `{"a":1,"b":[1,2],"c":{"x":"y","w":null}}`},
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

// TestFingerprintRefusesRepeatedNames: a body that two decoders could read
// two ways (a member name twice in one object, exactly or differing only
// in case, at any depth) has no fingerprint; the same names in different
// objects are fine.
func TestFingerprintRefusesRepeatedNames(t *testing.T) {
	refused := []string{
		`{"currency":"EUR","Currency":"USD"}`,
		`{"Currency":"USD","currency":"EUR"}`,
		`{"a":1,"a":1}`,
		`{"a":1,"\u0061":2}`,                      // the same name, escaped
		`{"items":[{"sku":"A","SKU":"B"}]}`,       // in an array
		`{"x":{"y":{"z":1,"Z":2}}}`,               // deep
		`{"k":1,"\u212a":2}`,                      // the Kelvin sign folds to k
		`{"stra\u00dfe":1,"STRA\u00dfE":2}`,       // non-ASCII letters fold too
		`[{"a":1},{"b":{"q":[1,{"r":1,"R":2}]}}]`, // after arrays and objects
	}
	for _, body := range refused {
		_, err := Fingerprint(httptest.NewRequest("POST", "/v1/orders", nil), []byte(body))
		if !errors.Is(err, ErrBadBody) {
			t.Errorf("Fingerprint(%s): got %v, want ErrBadBody", body, err)
		}
	}
	accepted := []string{
		`{"a":{"a":1},"b":{"a":2}}`,
		`[{"a":1},{"a":2}]`,
		`{"a":[{"b":1}],"b":[{"b":2}]}`,
		`{"ab":1,"a":{"b":1},"b":1}`,
		`not json {"a":1,"a":2`,
		``,
	}
	for _, body := range accepted {
		if _, err := Fingerprint(httptest.NewRequest("POST", "/v1/orders", nil), []byte(body)); err != nil {
			t.Errorf("Fingerprint(%s): %v, want a fingerprint", body, err)
		}
	}
}

// TestFingerprintRoutedPath: the path is fingerprinted as a router sees
// it, so a retry whose path a proxy normalised is the same request, while
// paths a router tells apart stay apart.
func TestFingerprintRoutedPath(t *testing.T) {
	fp := func(target string) string {
		t.Helper()
		s, err := Fingerprint(httptest.NewRequest("POST", target, nil), []byte(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	for _, c := range []struct{ a, b string }{
		{"/v1/orders", "/v1/%6Frders"},
		{"/v1/orders", "/v1/%6f%72%64%65%72%73"},
		{"/v1/caf%C3%A9", "/v1/café"},
	} {
		if fp(c.a) != fp(c.b) {
			t.Errorf("%s and %s: fingerprints differ, want equal", c.a, c.b)
		}
	}
	for _, c := range []struct{ a, b string }{
		{"/a%2Fb", "/a/b"},
		{"/a%252Fb", "/a%2Fb"},
		{"/v1/orders", "/v1/orders/"},
		{"/v1/orders", "//v1/orders"},
	} {
		if fp(c.a) == fp(c.b) {
			t.Errorf("%s and %s: fingerprints equal, want different", c.a, c.b)
		}
	}
}
