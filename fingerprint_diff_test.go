package idem

// The single-pass fingerprint (issue 11) against the reference, the
// implementation it replaced (fingerprint_ref_test.go): the same
// fingerprint for every method, path, query and body (Fingerprint against
// fpRefQueryFingerprint, FingerprintWithoutQuery against
// fpRefFingerprint), the same refusals (a *RepeatedMemberError matching
// ErrBadBody, naming the same spelling), the same canonicalJSON and
// CheckMemberNames. `go test` runs the seeds and
// TestFingerprintSameAsReferenceCases; `go test -run='^$'
// -fuzz=FuzzFingerprintSameAsReference .` searches further.

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"unicode/utf8"
)

// fpNastyBodies are bodies chosen to reach every branch of the single
// pass and of its fallback.
var fpNastyBodies = []string{
	`{"b":1,"a":2}`, `{"a":{"d":1,"c":[{"z":1,"y":2}]},"A1":0}`,
	`-0`, `-0.0e-0`, `1e400`, `-1E+400`, `0.1e1`, `123456789012345678901234567890.5e-99999`,
	`01`, `-`, `1.`, `.5`, `1e`, `1e+`, `+1`, `0x10`, `1 2`, `NaN`, `Infinity`, `-Infinity`,
	`tru`, `truex`, `nul`, `nulll`, `falsey`, `[true,false,null]`,
	`"\u0000\u001f\u007f\u0080\u00ff"`, `"\b\f\n\r\t\"\\\/"`, `"\'"`, `"\x"`, `"\u12"`, `"\u12g4"`, `"\U0041"`,
	`"\ud800"`, `"\udc00"`, `"\ud800\udc00"`, `"\udbff\udfff"`, `"\udc00\ud800"`, `"\ud800\ud800\udc00"`,
	`"\ud800\u0041"`, `"\ud800x"`, `"\ud800\"`, `"\ud800\u"`, `"\ud800\uzzzz"`, `"\ud83d\ude00"`,
	"\"\xff\"", "\"\xc3\"", "\"\xc3\xa9\"", "\"\xe2\x80\xa8\xe2\x80\xa9\"", "\"\xed\xa0\x80\"", "\"\xf4\x90\x80\x80\"",
	"\"\xc0\xaf\"", "\"\xef\xbf\xbd\"", `"\ufffd"`, `"<>&"`, `"\u003c\u003e\u0026"`, `"\u2028\u2029"`,
	"{\"\xff\":1,\"\xfe\":2}", "{\"\xff\":1,\"\\ufffd\":2}", `{"\ud800":1,"\udc00":2}`,
	"{\"a\xff\":1,\"A\xfe\":2}", "{\"<\":1,\"\\u003c\":2}", `{"é":1,"\u00c9":2}`, `{"é":1,"\u00e9":2}`,
	`{"a":1,"\u0061":2}`, `{"a":1,"\u0041":2}`, `{"k":1,"\u212a":2}`, `{"K":1,"\u212a":2}`, `{"s":1,"\u017f":2}`,
	`{"i":1,"\u0131":2}`, `{"I":1,"\u0130":2}`, `{"\u03a3":1,"\u03c2":2}`, `{"\u03c3":1,"\u03c2":2}`,
	`{"ss":1,"\u00df":2}`, `{"\u1e9e":1,"\u00df":2}`,
	`{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8,"i":9,"j":10,"k":11,"l":12}`,
	`{"l":1,"k":2,"j":3,"i":4,"h":5,"g":6,"f":7,"e":8,"d":9,"c":10,"b":11,"a":12}`,
	`{"l":1,"k":2,"j":3,"i":4,"h":5,"g":6,"f":7,"e":8,"d":9,"c":10,"b":11,"L":12}`,
	`{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8,"i":9,"j":10,"k":11,"\u212a":12}`,
	`{"a":1,"a":2}`, `{"a":1,"A":2}`, `{"a":{"x":1,"X":2},"a":3}`, `[{"a":1},{"a":1}]`, `{"a":[{"b":1,"B":1}],"A":1}`,
	`{"a":1,"b":2,"a":3`, `{"a":1,"a"`, `{"a":1,"A":}`, `{"a":1,"A"x`, `{"a" 1}`, `{"a":1,}`, `[1,]`, `[,1]`, `{,}`,
	`{"a":1}}`, `[1]]`, `{"a":1]`, `[1}`, `{1:2}`, `{"a"::1}`, `{"a":1 "b":2}`, `[1 2]`,
	`{"a":1}{"a":1,"a":2}`, `{"a":1} {"A":1,"a":2}`, `"a""b"`, `1 {"a":1,"A":2}`, `[] {"a":1,"a":2} x`,
	`{"a":1} x`, `{"a":1}x{"a":1,"a":2}`, `{"a":1}` + "\x00", "\x00", "\x00{}",
	"\ufeff{}", "\ufeff{\"a\":1,\"a\":2}", "{}\ufeff", "\v{}", "{}\v", "\f{}", "\u00a0{}", "{}\u00a0", "\u0085{}",
	"\t\n\r {}\t\n\r ", "", " ", "\t\n\r ", "\v", "\u00a0", "{\v}", "[\f1]", "{\"a\"\u00a0:1}",
	"\"a\nb\"", "\"a\tb\"", "\"a\x1fb\"", "\"a\x7fb\"",
	strings.Repeat("[", 199) + strings.Repeat("]", 199), strings.Repeat("[", 200) + strings.Repeat("]", 200),
	strings.Repeat("[", 201) + strings.Repeat("]", 201), strings.Repeat("[", 10000) + strings.Repeat("]", 10000),
	strings.Repeat("[", 10001) + strings.Repeat("]", 10001), strings.Repeat(`{"b":1,"a":`, 300) + "0" + strings.Repeat("}", 300),
	strings.Repeat(`{"b":1,"a":`, 150) + "0" + strings.Repeat("}", 150),
	strings.Repeat(`{"a":{"x":1,"X":2},"b":`, 250) + "0" + strings.Repeat("}", 250),
	strings.Repeat("[", 250) + `{"a":1,"A":2}` + strings.Repeat("]", 250),
	strings.Repeat("[", 100) + `{"a":1,"A":2}` + strings.Repeat("]", 100),
	strings.Repeat("[", 300) + "x",
}

var fpMethods = []string{http.MethodPost, http.MethodPut, "PATCH", "", "P\x00ST"}

var fpPaths = []string{
	"/v1/orders", "/v1/%6Frders", "/a%2Fb", "/a/b", "/items/%2E%2E", "/items/..", "/x%00r", "/%zz", "/%", "/",
	"/caf%C3%A9", "/caf\xc3\xa9", "/a b", "/a%20b", "//x", "/a;b", "/%25", "/a/%2e",
}

// fpQueries are raw query strings chosen to reach every branch of the
// query's canonical form: empty segments, names without "=", escapes good
// and bad, "+", ";", bytes a URL would escape, names out of order and
// repeated, more parameters than an insertion sort likes.
var fpQueries = []string{
	"", "&", "&&", "a", "a=", "=", "==", "=a", "a==", "a=1&b=2", "b=2&a=1", "a=1&a=2", "a=2&a=1", "b=1&a=2&a=1",
	"%61=1", "a=%31", "a=b+c", "a=b%20c", "a=b%2Bc", "a=b%2bc", "+=+", "%2B=%2B", "a+b=c", "a%20b=c",
	"a=b&c", "a=b%26c", "a%3Db=c", "a=b=c", "a%3D=b", "a=%3D",
	"a=%zz", "a=%25zz", "a=%", "a=%2", "a=%%", "%zz", "%", "%zz=1", "a=%zz&a=1", "a=1&a=%zz", "a=%zz&a%3D%25zz=1",
	"a;b", "a=1;b=2", "a=1%3Bb=2", ";", "a=;", ";=1&a=1",
	"a=%00", "%00=1", "\x00", "a=\x00", "a=\xff", "a=%ff", "a=\xc3\xa9", "caf%C3%A9=1", "café=1", "\xff=\xfe&\xfe=\xff",
	"q=%2525", "x=1&&&y=2&", "&a=1", "a=1&", "a=1&A=1", "A=1&a=1", "a=1#frag", "a=1?b=2", "a=1/b", "a b=c d",
	"a=1&a&a=&a=2", "z&y&x=1&w=", "a%26b=1", "a%2=1", "a%g0=1",
	strings.Repeat("z=1&y=2&", 30) + "a=0", strings.Repeat("k=v&", 20) + strings.Repeat("k&", 20),
}

// fpRequest builds a request for path with query as its raw query (a
// query in path is replaced); a path that does not parse is taken as /.
func fpRequest(method, path, query string) *http.Request {
	u, err := url.Parse(path)
	if err != nil {
		u = &url.URL{Path: "/"}
	}
	u.RawQuery = query
	return &http.Request{Method: method, URL: u, Header: http.Header{}}
}

// fpSameError fails unless a and b are both nil, or both a
// *RepeatedMemberError naming the same spelling and matching ErrBadBody.
func fpSameError(t *testing.T, what string, body []byte, got, want error) {
	t.Helper()
	if (got == nil) != (want == nil) {
		t.Fatalf("%s(%q): error %v, reference %v", what, body, got, want)
	}
	if got == nil {
		return
	}
	var g, w *RepeatedMemberError
	if !errors.As(got, &g) || !errors.As(want, &w) {
		t.Fatalf("%s(%q): %T %v, reference %T %v", what, body, got, got, want, want)
	}
	if g.Name != w.Name || got.Error() != want.Error() {
		t.Fatalf("%s(%q): names %q, reference %q", what, body, g.Name, w.Name)
	}
	if !errors.Is(got, ErrBadBody) || !errors.Is(want, ErrBadBody) {
		t.Fatalf("%s(%q): %v does not match ErrBadBody", what, body, got)
	}
}

func fpCompare(t *testing.T, method, path, query string, body []byte) {
	t.Helper()
	keep := bytes.Clone(body)
	r := fpRequest(method, path, query)
	got, gerr := Fingerprint(r, body)
	want, werr := fpRefQueryFingerprint(fpRequest(method, path, query), body)
	fpSameError(t, "Fingerprint", body, gerr, werr)
	if got != want {
		t.Fatalf("Fingerprint(%q %q ? %q, %q) = %s, reference %s", method, path, query, body, got, want)
	}
	gotW, gerr := FingerprintWithoutQuery(r, body)
	wantW, werr := fpRefFingerprint(fpRequest(method, path, query), body)
	fpSameError(t, "FingerprintWithoutQuery", body, gerr, werr)
	if gotW != wantW {
		t.Fatalf("FingerprintWithoutQuery(%q %q ? %q, %q) = %s, reference %s", method, path, query, body, gotW, wantW)
	}
	c := fpGet()
	sec := bytes.Clone(c.appendQuery(nil, query))
	fpPut(c)
	if want := fpRefQuerySection(query); !bytes.Equal(sec, want) {
		t.Fatalf("the hashed form of the query %q = %q, reference %q", query, sec, want)
	}
	if len(sec) == 0 && got != gotW {
		t.Fatalf("the query %q names no parameter, yet Fingerprint = %s and FingerprintWithoutQuery = %s", query, got, gotW)
	}
	fpSameError(t, "CheckMemberNames", body, CheckMemberNames(body), fpRefCheckMemberNames(body))
	gc, gok := canonicalJSON(body)
	wc, wok := fpRefCanonicalJSON(body)
	if gok != wok || !bytes.Equal(gc, wc) {
		t.Fatalf("canonicalJSON(%q) = %q, %v; reference %q, %v", body, gc, gok, wc, wok)
	}
	if gok && gc == nil {
		t.Fatalf("canonicalJSON(%q): ok with nil bytes", body)
	}
	if got, want := routedPath(r.URL), fpRefRoutedPath(r.URL); got != want {
		t.Fatalf("routedPath(%q) = %q, reference %q", path, got, want)
	}
	if !bytes.Equal(body, keep) {
		t.Fatalf("the body changed: %q, was %q", body, keep)
	}
}

// fpSeeds are every body the fuzz tests of the fingerprint know, the
// nasty ones above, and for each pair of the names FuzzMemberNameFold
// tries, an object holding both.
func fpSeeds() []string {
	seeds := append(append([]string{}, fuzzBodies...), fpNastyBodies...)
	seeds = append(seeds, "\x00r", `{"a":1}`, ` { "a" : 1 } `, `{"a":1.0}`, `not json`, `not  json`, `"j"`, `j"j"`, `{}`)
	names := []string{"K", "\u212a", "k", "S", "\u017f", "s", "I", "i", "\u0130", "\u0131", "ẞ", "ß", "SS", "Σ", "ς", "σ",
		"ϑ", "ϴ", "Θ", "θ", "Ǆ", "ǅ", "ǆ", "Ǉ", "Å", "å", "\u212b", "Μ", "μ", "\u00b5", "Ω", "ω", "\u2126",
		"\u0390", "\u1fd3", "\u1fe3", "\u03b0", "ﬆ", "ﬅ", "ID", "iD", "Id", "currency", "CURRENCY", "STRASSE", "STRAẞE",
		"Straße", "-", "", "\xff", "\ufffd", "\\ufffd", "\\ud800", "\\u212a", "\\u0130", "\\u0131", "\\u0069", "<", "\\u003c"}
	for _, a := range names {
		for _, b := range names {
			seeds = append(seeds, `{"`+a+`":1,"`+b+`":2}`)
		}
	}
	return seeds
}

// TestFingerprintSameAsReferenceCases runs the seeds under every method, path and
// query, every byte and a spread of escapes inside a string value, a
// name and a query, and checks that the single pass itself decides the
// usual bodies (so that the comparison is not only the fallback against
// itself).
func TestFingerprintSameAsReferenceCases(t *testing.T) {
	n := 0
	for _, body := range fpSeeds() {
		for i, m := range fpMethods {
			fpCompare(t, m, fpPaths[(i+n)%len(fpPaths)], fpQueries[(i+n)%len(fpQueries)], []byte(body))
		}
		n++
	}
	for _, p := range fpPaths {
		fpCompare(t, http.MethodPost, p, "", []byte(`{"a":1}`))
	}
	for i, q := range fpQueries {
		for _, body := range []string{`{"a":1}`, ``, "\x00r", `not json`} {
			fpCompare(t, http.MethodPost, fpPaths[i%len(fpPaths)], q, []byte(body))
		}
		for _, q2 := range fpQueries[:12] {
			fpCompare(t, http.MethodPost, "/", q+"&"+q2, []byte(`{}`))
			fpCompare(t, http.MethodPost, "/", q2+"&"+q, []byte(`{}`))
		}
	}
	for b := 0; b < 256; b++ {
		s := string([]byte{byte(b)})
		for _, body := range []string{`"x` + s + `y"`, `{"x` + s + `y":1,"X` + s + `Y":2}`, `{"x` + s + `":1,"a":2}`, s, `[` + s + `]`, `{"a":1}` + s, s + `{"a":1}`} {
			fpCompare(t, http.MethodPost, "/", "", []byte(body))
		}
		for _, q := range []string{"a=" + s, s + "=1", "x" + s + "y", "a=%" + s + "0", "a=%0" + s, s, "b=1&" + s + "&a=1"} {
			fpCompare(t, http.MethodPost, "/", q, []byte(`{}`))
		}
	}
	for _, r := range []rune{0, 1, 8, 9, 10, 12, 13, 0x1f, ' ', '"', '&', '<', '>', '\\', '/', 0x7f, 0x80, 0xe9, 0x212a,
		0x2028, 0x2029, 0xd7ff, 0xd800, 0xdbff, 0xdc00, 0xdfff, 0xe000, 0xfeff, 0xfffd, 0xffff} {
		for _, esc := range []string{fmt.Sprintf(`\u%04x`, r), fmt.Sprintf(`\u%04X`, r)} {
			for _, body := range []string{`"` + esc + `"`, `{"` + esc + `":1,"a":2}`, `"` + esc + `\udc00"`, `"\ud800` + esc + `"`, `"` + esc + "\xff\"",
				`{"` + esc + `":1,"` + string(r) + `":2}`} {
				fpCompare(t, http.MethodPost, "/", "", []byte(body))
			}
		}
	}
	c := fpGet()
	defer fpPut(c)
	for _, body := range []string{`{"a":1,"b":[1,2],"c":{"x":"y","w":null}}`, fuzzBodies[1], fuzzBodies[2], fuzzBodies[3], fuzzBodies[4], fuzzBodies[5],
		`{"b":1,"a":2}`, `{"a":{"d":1,"c":[{"z":1,"y":2}]},"A1":0}`, `{"sku":"sku_42","quantity":1,"currency":"EUR","note":"benchmark"}`,
		`{"l":1,"k":2,"j":3,"i":4,"h":5,"g":6,"f":7,"e":8,"d":9,"c":10,"b":11,"a":12}`, "\"\xff\\ud800\u2028<\"",
		strings.Repeat("[", 200) + strings.Repeat("]", 200), strings.Repeat(`{"b":1,"a":`, 150) + "0" + strings.Repeat("}", 150)} {
		if !c.run([]byte(body)) {
			t.Errorf("the single pass leaves %.80q to encoding/json", body)
		}
	}
	for _, body := range []string{`{"a":1,"A":2}`, `{"a":1,"a":2}`, `{"a":1`, `{"a":1} {}`, "\ufeff{}", "{\"\\'\":1}", strings.Repeat("[", 201) + strings.Repeat("]", 201)} {
		if c.run([]byte(body)) {
			t.Errorf("the single pass decides %.80q itself", body)
		}
	}
}

func FuzzFingerprintSameAsReference(f *testing.F) {
	for i, body := range fpSeeds() {
		f.Add(fpMethods[i%len(fpMethods)], fpPaths[i%len(fpPaths)], fpQueries[i%len(fpQueries)], []byte(body))
	}
	for i, q := range fpQueries {
		f.Add(fpMethods[i%len(fpMethods)], fpPaths[i%len(fpPaths)], q, []byte(`{"a":1}`))
	}
	f.Add("POST", "/x%00r", "", []byte(""))
	f.Add("POST", "/x", "", []byte("\x00r"))
	f.Add("\u0130", "/items/%00/x%00r", "a=%00&\x00", []byte("\u0131"))
	f.Fuzz(func(t *testing.T, method, path, query string, body []byte) {
		fpCompare(t, method, path, query, body)
		if utf8.Valid(body) && len(body) < 4096 {
			// The same body as one member's value and as a name.
			fpCompare(t, method, path, query, append(append([]byte(`{"z":0,"a":`), body...), '}'))
		}
	})
}
