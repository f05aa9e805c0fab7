package idem

// Fuzz tests of the fingerprint's parsers (issue 10, point 5): canonical
// JSON, the member-name check and the routed path. `go test` runs the
// seeds; `go test -run='^$' -fuzz=FuzzName .` searches further.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"reflect"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

// fuzzBodies are the JSON (and not quite JSON) seeds the body fuzzers share.
var fuzzBodies = []string{
	`{"a":1,"b":[1,2],"c":{"x":"y","w":null}}`,
	" {\n\"c\" : {\"w\":null,\"x\":\"y\"}, \"b\":[ 1 ,2 ],\"a\":1}\n",
	`{"a":1.0,"b":-0,"c":1e400,"d":-12.5E-3,"e":123456789012345678901234567890}`,
	`{"s":"\u00e9\ud83d\ude00\n\t\"\\\/<>&\u2028\u2029\u0000"}`,
	`{"s":"\ud800 lone surrogate","t":"\udc00"}`,
	"{\"s\":\"\xff\xfe not utf-8\"}",
	`[{"a":1},{"b":{"q":[1,{"r":1,"R":2}]}}]`,
	`{"currency":"EUR","Currency":"USD"}`,
	`{"a":1,"\u0061":2}`,
	`{"k":1,"\u212a":2}`,
	`{"stra\u00dfe":1,"STRA\u00dfE":2}`,
	`{"i":1,"\u0130":2}`,
	`{"s":1,"\u017f":2}`,
	`{"\u0390":1,"\u1fd3":2}`,
	`{"a":{"a":1},"b":{"a":2}}`,
	`{"ab":1,"a":{"b":1},"b":1}`,
	`{"":1,"x":{"":{"":[]}}}`,
	`[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[{}]]]]]]]]]]]]]]]]]]]]]]]]]]]]]`,
	`true`, `null`, `"x"`, `0`, `[]`, `{}`,
	`{"a":1} {"b":2}`,
	`{"a":1} {"a":1,"a":2}`,
	`{"a":1,"a":2`,
	`not json {"a":1,"a":2`,
	`{"a":}`,
	``, ` `, `}`, `]`, `[}`,
}

// fuzzNode is one JSON value as written, object members in order and
// repeated names kept (a decoded map would lose them).
type fuzzNode struct {
	kind  byte   // 'o' object, 'a' array, 's' string, 'n' number, 'b' bool, 'z' null
	text  string // a string's value, a number's literal, "true" or "false"
	names []string
	kids  []*fuzzNode
}

// fuzzParse reads body as exactly one JSON value, as canonicalJSON does.
func fuzzParse(body []byte) (*fuzzNode, bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	n, err := fuzzParseValue(dec)
	if err != nil {
		return nil, false
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, false
	}
	return n, true
}

func fuzzParseValue(dec *json.Decoder) (*fuzzNode, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch v := tok.(type) {
	case json.Delim:
		switch v {
		case '{':
			n := &fuzzNode{kind: 'o'}
			for dec.More() {
				nt, err := dec.Token()
				if err != nil {
					return nil, err
				}
				name, ok := nt.(string)
				if !ok {
					return nil, fmt.Errorf("member name %v", nt)
				}
				kid, err := fuzzParseValue(dec)
				if err != nil {
					return nil, err
				}
				n.names = append(n.names, name)
				n.kids = append(n.kids, kid)
			}
			if _, err := dec.Token(); err != nil {
				return nil, err
			}
			return n, nil
		case '[':
			n := &fuzzNode{kind: 'a'}
			for dec.More() {
				kid, err := fuzzParseValue(dec)
				if err != nil {
					return nil, err
				}
				n.kids = append(n.kids, kid)
			}
			if _, err := dec.Token(); err != nil {
				return nil, err
			}
			return n, nil
		}
		return nil, fmt.Errorf("unexpected %v", v)
	case string:
		return &fuzzNode{kind: 's', text: v}, nil
	case json.Number:
		return &fuzzNode{kind: 'n', text: string(v)}, nil
	case bool:
		return &fuzzNode{kind: 'b', text: fmt.Sprint(v)}, nil
	case nil:
		return &fuzzNode{kind: 'z'}, nil
	}
	return nil, fmt.Errorf("token %T", tok)
}

// fuzzRand is splitmix64: the fuzzer picks the seed, the rest follows.
type fuzzRand struct{ s uint64 }

func (r *fuzzRand) next() uint64 {
	r.s += 0x9e3779b97f4a7c15
	z := r.s
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

func (r *fuzzRand) intn(n int) int { return int(r.next() % uint64(n)) }

// fuzzEncode writes n with the same meaning and another spelling: members
// shuffled, white space sprinkled, characters escaped or not at random.
func fuzzEncode(b *bytes.Buffer, n *fuzzNode, r *fuzzRand) {
	ws := func() {
		for k := r.intn(4); k > 0; k-- {
			b.WriteByte(" \t\n\r"[r.intn(4)])
		}
	}
	ws()
	switch n.kind {
	case 'o':
		b.WriteByte('{')
		order := make([]int, len(n.names))
		for i := range order {
			order[i] = i
		}
		for i := len(order) - 1; i > 0; i-- {
			j := r.intn(i + 1)
			order[i], order[j] = order[j], order[i]
		}
		for k, i := range order {
			if k > 0 {
				b.WriteByte(',')
			}
			fuzzEncodeString(b, n.names[i], r)
			ws()
			b.WriteByte(':')
			fuzzEncode(b, n.kids[i], r)
		}
		ws()
		b.WriteByte('}')
	case 'a':
		b.WriteByte('[')
		for i, kid := range n.kids {
			if i > 0 {
				b.WriteByte(',')
			}
			fuzzEncode(b, kid, r)
		}
		ws()
		b.WriteByte(']')
	case 's':
		fuzzEncodeString(b, n.text, r)
	case 'n', 'b':
		b.WriteString(n.text)
	case 'z':
		b.WriteString("null")
	}
	ws()
}

func fuzzEncodeString(b *bytes.Buffer, s string, r *fuzzRand) {
	b.WriteByte('"')
	for _, c := range s { // s came from the decoder: valid UTF-8
		switch {
		case c == '"' || c == '\\':
			if r.intn(2) == 0 {
				b.WriteByte('\\')
				b.WriteRune(c)
			} else {
				fmt.Fprintf(b, `\u%04X`, c)
			}
		case c == '/' && r.intn(2) == 0:
			b.WriteString(`\/`)
		case c == '\n' && r.intn(2) == 0:
			b.WriteString(`\n`)
		case c < 0x20 || r.intn(3) == 0:
			if c > 0xffff {
				c -= 0x10000
				fmt.Fprintf(b, `\u%04x\u%04X`, 0xd800+(c>>10), 0xdc00+(c&0x3ff))
			} else {
				fmt.Fprintf(b, `\u%04x`, c)
			}
		default:
			b.WriteRune(c)
		}
	}
	b.WriteByte('"')
}

// fuzzHasFoldedDup reports whether an object anywhere in n names one
// member twice, as encoding/json matches names (foldName; FuzzMemberNameFold
// holds foldName to what encoding/json does).
func fuzzHasFoldedDup(n *fuzzNode) bool {
	if n.kind == 'o' {
		seen := map[string]bool{}
		for _, name := range n.names {
			f := foldName(name)
			if seen[f] {
				return true
			}
			seen[f] = true
		}
	}
	for _, kid := range n.kids {
		if fuzzHasFoldedDup(kid) {
			return true
		}
	}
	return false
}

// fuzzSameTree: v, as encoding/json decoded it (numbers as json.Number),
// holds every member and element of n, none lost or merged.
func fuzzSameTree(n *fuzzNode, v any) error {
	switch n.kind {
	case 'o':
		m, ok := v.(map[string]any)
		if !ok {
			return fmt.Errorf("object decoded as %T", v)
		}
		if len(m) != len(n.names) {
			return fmt.Errorf("object of %d members decoded to %d", len(n.names), len(m))
		}
		for i, name := range n.names {
			kv, ok := m[name]
			if !ok {
				return fmt.Errorf("member %q lost", name)
			}
			if err := fuzzSameTree(n.kids[i], kv); err != nil {
				return fmt.Errorf("%q: %w", name, err)
			}
		}
	case 'a':
		a, ok := v.([]any)
		if !ok || len(a) != len(n.kids) {
			return fmt.Errorf("array of %d decoded as %T %v", len(n.kids), v, v)
		}
		for i, kid := range n.kids {
			if err := fuzzSameTree(kid, a[i]); err != nil {
				return fmt.Errorf("[%d]: %w", i, err)
			}
		}
	case 's':
		if s, ok := v.(string); !ok || s != n.text {
			return fmt.Errorf("string %q decoded as %#v", n.text, v)
		}
	case 'n':
		if s, ok := v.(json.Number); !ok || string(s) != n.text {
			return fmt.Errorf("number %s decoded as %#v", n.text, v)
		}
	case 'b':
		if s, ok := v.(bool); !ok || fmt.Sprint(s) != n.text {
			return fmt.Errorf("%s decoded as %#v", n.text, v)
		}
	case 'z':
		if v != nil {
			return fmt.Errorf("null decoded as %#v", v)
		}
	}
	return nil
}

// fuzzMutate changes the meaning of one scalar of n (picked by r) in
// place; it reports false if n has no scalar.
func fuzzMutate(n *fuzzNode, r *fuzzRand) bool {
	var scalars []*fuzzNode
	var walk func(*fuzzNode)
	walk = func(n *fuzzNode) {
		if n.kind != 'o' && n.kind != 'a' {
			scalars = append(scalars, n)
		}
		for _, kid := range n.kids {
			walk(kid)
		}
	}
	walk(n)
	if len(scalars) == 0 {
		return false
	}
	s := scalars[r.intn(len(scalars))]
	switch s.kind {
	case 's':
		s.text += "x"
	case 'n':
		s.kind = 's' // 1 becomes "1"

	case 'b':
		s.kind, s.text = 'z', ""
	case 'z':
		s.kind, s.text = 'b', "false"
	}
	return true
}

func fuzzRequest(target string) *http.Request {
	u, err := url.ParseRequestURI(target)
	if err != nil {
		return nil
	}
	return &http.Request{Method: http.MethodPost, URL: u, Header: http.Header{}}
}

func fuzzFingerprint(t *testing.T, r *http.Request, body []byte) (string, bool) {
	t.Helper()
	fp, err := Fingerprint(r, body)
	if err != nil {
		if !errors.Is(err, ErrBadBody) {
			t.Fatalf("Fingerprint(%q): %v, not ErrBadBody", body, err)
		}
		return "", false
	}
	if len(fp) != 64 {
		t.Fatalf("Fingerprint(%q) = %q: not 64 hex digits", body, fp)
	}
	return fp, true
}

// FuzzCanonicalJSON: canonicalJSON and Fingerprint never panic;
// canonicalJSON accepts exactly one JSON value, gives valid JSON, is
// idempotent and keeps the meaning; the same value spelt another way
// (members shuffled, white space, escapes) has the same canonical form
// and the same fingerprint, or is refused as the first; a value whose
// meaning changed has another canonical form and another fingerprint.
func FuzzCanonicalJSON(f *testing.F) {
	for i, b := range fuzzBodies {
		f.Add([]byte(b), uint64(i))
	}
	f.Fuzz(func(t *testing.T, body []byte, seed uint64) {
		req := fuzzRequest("/v1/orders")
		c, ok := canonicalJSON(body)
		fp, accepted := fuzzFingerprint(t, req, body)
		tree, one := fuzzParse(body)
		if ok != one {
			t.Fatalf("canonicalJSON(%q) ok = %v; exactly one JSON value: %v", body, ok, one)
		}
		if !ok {
			return
		}
		if !json.Valid(c) {
			t.Fatalf("canonicalJSON(%q) = %q: not JSON", body, c)
		}
		if c2, ok := canonicalJSON(c); !ok || !bytes.Equal(c2, c) {
			t.Fatalf("canonicalJSON(%q) = %q, but canonicalJSON of that = %q, %v", body, c, c2, ok)
		}
		if accepted == fuzzHasFoldedDup(tree) {
			t.Fatalf("Fingerprint(%q) accepted = %v, a repeated member name = %v", body, accepted, !accepted)
		}
		if accepted {
			// The canonical form means what the body means.
			var v any
			dec := json.NewDecoder(bytes.NewReader(c))
			dec.UseNumber()
			if err := dec.Decode(&v); err != nil {
				t.Fatal(err)
			}
			if err := fuzzSameTree(tree, v); err != nil {
				t.Fatalf("canonicalJSON(%q) = %q: %v", body, c, err)
			}
		}

		r := &fuzzRand{s: seed}
		var b bytes.Buffer
		fuzzEncode(&b, tree, r)
		same := b.Bytes()
		if c2, ok := canonicalJSON(same); !ok || (accepted && !bytes.Equal(c2, c)) {
			t.Fatalf("%q and %q mean the same; canonical %q and %q, %v", body, same, c, c2, ok)
		}
		fp2, accepted2 := fuzzFingerprint(t, req, same)
		if accepted2 != accepted || fp2 != fp {
			t.Fatalf("%q and %q mean the same; fingerprints %q (%v) and %q (%v)", body, same, fp, accepted, fp2, accepted2)
		}

		if !fuzzMutate(tree, r) {
			return
		}
		b.Reset()
		fuzzEncode(&b, tree, r)
		other := b.Bytes()
		c3, ok := canonicalJSON(other)
		if !ok {
			t.Fatalf("canonicalJSON(%q), a changed %q, refused", other, body)
		}
		fp3, accepted3 := fuzzFingerprint(t, req, other)
		if accepted3 != accepted {
			t.Fatalf("%q accepted = %v, but %q, its values changed, = %v", body, accepted, other, accepted3)
		}
		if accepted && (bytes.Equal(c3, c) || fp3 == fp) {
			t.Fatalf("%q and %q mean different things; canonical %q and %q, fingerprints %s and %s", body, other, c, c3, fp, fp3)
		}
	})
}

// FuzzCheckMemberNames: CheckMemberNames never panics and refuses only
// with ErrBadBody; on one JSON value it refuses exactly when an object at
// some depth names a member twice as encoding/json matches names; a body
// it accepts decodes with encoding/json into map[string]any with every
// member kept (as many members per object as distinct folded names).
func FuzzCheckMemberNames(f *testing.F) {
	for _, b := range fuzzBodies {
		f.Add([]byte(b))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		err := CheckMemberNames(body)
		if err != nil && !errors.Is(err, ErrBadBody) {
			t.Fatalf("CheckMemberNames(%q) = %v, not ErrBadBody", body, err)
		}
		tree, one := fuzzParse(body)
		if !one {
			return
		}
		dup := fuzzHasFoldedDup(tree)
		if dup != (err != nil) {
			t.Fatalf("CheckMemberNames(%q) = %v; a repeated (folded) name: %v", body, err, dup)
		}
		if err != nil {
			return
		}
		var v any
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.UseNumber()
		if err := dec.Decode(&v); err != nil {
			t.Fatalf("CheckMemberNames accepted %q, encoding/json: %v", body, err)
		}
		if err := fuzzSameTree(tree, v); err != nil {
			t.Fatalf("CheckMemberNames accepted %q, but encoding/json loses: %v", body, err)
		}
	})
}

// fuzzFields is a struct whose tags are names no two of which
// encoding/json confuses; FuzzMemberNameFold asks encoding/json which of
// them a fuzzed name would fill.
type fuzzFields struct {
	K        *int `json:"k"`
	S        *int `json:"s"`
	I        *int `json:"i"`
	Sz       *int `json:"ß"`
	Sigma    *int `json:"σ"`
	Theta    *int `json:"θ"`
	Dz       *int `json:"ǆ"`
	Lj       *int `json:"ǈ"`
	Aring    *int `json:"å"`
	Mu       *int `json:"µ"`
	Omega    *int `json:"ω"`
	Iota     *int `json:"ΐ"`
	Upsilon  *int `json:"ΰ"`
	St       *int `json:"ﬅ"`
	ID       *int `json:"id"`
	Currency *int `json:"Currency"`
	Strasse  *int `json:"straße"`
	Empty    *int `json:"-,"` //nolint:staticcheck // SA5008: a member named "-", on purpose
}

// FuzzMemberNameFold: two names in one object are refused exactly when
// they are the same name or encoding/json would fill one struct field
// with either (it matches names without regard to case).
func FuzzMemberNameFold(f *testing.F) {
	for _, s := range []string{
		"K", "\u212a", "S", "\u017f", "I", "\u0130", "\u0131", "ẞ", "SS", "Σ", "ς",
		"ϑ", "ϴ", "Θ", "Ǆ", "ǅ", "Ǉ", "Å", "\u212b", "Μ", "μ", "Ω", "\u2126",
		"\u1fd3", "\u1fe3", "ﬆ", "ID", "iD", "Id", "currency", "CURRENCY", "STRASSE", "STRAẞE",
		"Straße", "-", "", "\xff",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		key, _ := json.Marshal(name)
		if err := json.Unmarshal(key, &name); err != nil { // as a decoder reads it
			t.Fatal(err)
		}
		var filled fuzzFields
		if err := json.Unmarshal([]byte(`{`+string(key)+`:1}`), &filled); err != nil {
			t.Fatal(err)
		}
		fv := reflect.ValueOf(filled)
		ft := fv.Type()
		for i := 0; i < ft.NumField(); i++ {
			tag := strings.Split(ft.Field(i).Tag.Get("json"), ",")[0]
			same := name == tag || !fv.Field(i).IsNil()
			tagKey, _ := json.Marshal(tag)
			body := `{` + string(tagKey) + `:1,` + string(key) + `:2}`
			err := CheckMemberNames([]byte(body))
			if same != (err != nil) {
				t.Errorf("CheckMemberNames(%s) = %v; encoding/json reads the two as one field: %v", body, err, same)
			}
		}
	})
}

// fuzzUnreserved: RFC 3986 unreserved characters, whose percent-encoding
// means nothing to a router.
func fuzzUnreserved(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' ||
		c == '-' || c == '.' || c == '_' || c == '~'
}

func fuzzUnhex(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// fuzzReencode spells the escaped path ep another way a router reads the
// same: unreserved characters percent-encoded or decoded, hex digits in
// either case, at random; literal dot segments kept literal.
func fuzzReencode(ep string, r *fuzzRand) string {
	segs := strings.Split(ep, "/")
	for i, seg := range segs {
		if seg == "." || seg == ".." {
			continue
		}
		var b strings.Builder
		for j := 0; j < len(seg); j++ {
			c := seg[j]
			if c == '%' && j+2 < len(seg) {
				hi, ok1 := fuzzUnhex(seg[j+1])
				lo, ok2 := fuzzUnhex(seg[j+2])
				if ok1 && ok2 {
					d := hi<<4 | lo
					switch {
					case fuzzUnreserved(d) && r.intn(2) == 0:
						b.WriteByte(d)
					case r.intn(2) == 0:
						fmt.Fprintf(&b, "%%%02x", d)
					default:
						fmt.Fprintf(&b, "%%%02X", d)
					}
					j += 2
					continue
				}
			}
			if fuzzUnreserved(c) && r.intn(3) == 0 {
				if r.intn(2) == 0 {
					fmt.Fprintf(&b, "%%%02x", c)
				} else {
					fmt.Fprintf(&b, "%%%02X", c)
				}
				continue
			}
			b.WriteByte(c)
		}
		if s := b.String(); s != "." && s != ".." {
			segs[i] = s
		}
	}
	return strings.Join(segs, "/")
}

// FuzzRoutedPath: Fingerprint never panics on a path; the routed path
// holds no NUL (the separator of the hashed fields); a path spelt another
// way a router reads alike (unreserved characters percent-encoded or
// not, hex digits in either case) has the same fingerprint; a path a
// router reads otherwise ("/" inside a segment as %2F, "%" as %25, a
// literal dot segment escaped) has another.
func FuzzRoutedPath(f *testing.F) {
	for i, p := range []string{
		"/v1/orders", "/v1/%6Frders", "/v1/%6f%72%64%65%72%73", "/v1/caf%C3%A9",
		"/a%2Fb", "/a/b", "/a%252Fb", "/v1/orders/", "//v1/orders",
		"/items/..", "/items/%2E%2E", "/items/.", "/items/%2e", "/items/%2E.",
		"/items/x/../y", "/items/x%2F..%2Fy", "/a%00b", "/~user/a-b_c.d",
		"/a;b=c/d@e:f!$&'()*+,", "/%41%42%43", "/%7e%7E", "/%zz", "/%", "/a?b=c",
	} {
		f.Add(p, uint64(i))
	}
	f.Fuzz(func(t *testing.T, p string, seed uint64) {
		req := fuzzRequest(p)
		if req == nil {
			return
		}
		// The path alone: the respellings below are of the path, and
		// FuzzFingerprintQuery and FuzzFingerprintDistinct take the query.
		req.URL.RawQuery = ""
		fp, ok := fuzzFingerprint(t, req, []byte(`{}`))
		if !ok {
			t.Fatalf("Fingerprint(%q) refused {}", p)
		}
		if rp := routedPath(req.URL); strings.IndexByte(rp, 0) >= 0 {
			t.Fatalf("routedPath(%q) = %q: holds a NUL, which separates the hashed fields", p, rp)
		}
		// Only paths whose escaped form the URL keeps as it came: one a
		// router can tell apart by its escapes.
		ep := req.URL.EscapedPath()
		if ep == "" || ep[0] != '/' || !utf8.ValidString(ep) {
			return
		}
		if _, err := url.PathUnescape(ep); err != nil {
			return
		}
		fpOf := func(ep string) (string, bool) {
			r := fuzzRequest(ep)
			if r == nil || r.URL.EscapedPath() != ep {
				return "", false
			}
			fp, ok := fuzzFingerprint(t, r, []byte(`{}`))
			if !ok {
				t.Fatalf("Fingerprint(%q) refused {}", ep)
			}
			return fp, true
		}
		if fp0, ok := fpOf(ep); !ok || fp0 != fp {
			return // not stable under a re-parse
		}
		r := &fuzzRand{s: seed}
		if alt := fuzzReencode(ep, r); alt != ep {
			if fp2, ok := fpOf(alt); ok && fp2 != fp {
				t.Fatalf("%q and %q route alike, fingerprints differ", ep, alt)
			}
		}
		// Changes a router sees.
		var changed []string
		for i := 1; i < len(ep); i++ {
			switch ep[i] {
			case '/':
				changed = append(changed, ep[:i]+"%2F"+ep[i+1:])
			case '%':
				changed = append(changed, ep[:i]+"%25"+ep[i+1:])
			}
		}
		segs := strings.Split(ep, "/")
		for i, seg := range segs {
			if seg == "." || seg == ".." {
				alt := append([]string(nil), segs...)
				alt[i] = strings.Repeat("%2E", len(seg))
				changed = append(changed, strings.Join(alt, "/"))
			}
		}
		if len(changed) == 0 {
			return
		}
		alt := changed[r.intn(len(changed))]
		if fp2, ok := fpOf(alt); ok && fp2 == fp {
			t.Fatalf("%q and %q route apart, fingerprints equal", ep, alt)
		}
	})
}

// FuzzFingerprintDistinct: two requests (path and query, body) have one
// fingerprint exactly when a router sees one path, the queries name the
// same parameters in canonical order (fpRefParams) and the bodies are one
// JSON value in canonical form, or the same bytes when not JSON.
func FuzzFingerprintDistinct(f *testing.F) {
	f.Add("/v1/orders", []byte(`{"a":1}`), "/v1/orders", []byte(` { "a" : 1 } `))
	f.Add("/v1/orders", []byte(`{"a":1}`), "/v1/orders", []byte(`{"a":1.0}`))
	f.Add("/v1/orders", []byte(`{"a":1}`), "/v1/%6Frders", []byte(`{"a":1}`))
	f.Add("/a/b", []byte(`{}`), "/a%2Fb", []byte(`{}`))
	f.Add("/x", []byte(`not json`), "/x", []byte(`not  json`))
	f.Add("/x", []byte(`"j"`), "/x", []byte(`j"j"`))
	f.Add("/x", []byte("\x00r"), "/x%00r", []byte("")) // a collision before NUL was escaped
	f.Add("/x?a=b&c", []byte(`{}`), "/x?a=b%26c", []byte(`{}`))
	f.Add("/x?b=2&a=1", []byte(`{}`), "/x?a=1&&b=2", []byte(`{}`))
	f.Add("/x?%61=b+c", []byte(`{}`), "/x?a=b%20c", []byte(`{}`))
	f.Add("/x?a", []byte(`{}`), "/x?a=", []byte(`{}`))
	f.Add("/x?", []byte(`{}`), "/x", []byte(`{}`))
	f.Add("/x?a=%zz", []byte(`{}`), "/x?a=%25zz", []byte(`{}`))
	f.Fuzz(func(t *testing.T, pa string, ba []byte, pb string, bb []byte) {
		ra, rb := fuzzRequest(pa), fuzzRequest(pb)
		if ra == nil || rb == nil {
			return
		}
		fa, oka := fuzzFingerprint(t, ra, ba)
		fb, okb := fuzzFingerprint(t, rb, bb)
		if !oka || !okb {
			return
		}
		bodyKey := func(b []byte) string {
			if c, ok := canonicalJSON(b); ok {
				return "j" + string(c)
			}
			return "r" + string(b)
		}
		same := routedPath(ra.URL) == routedPath(rb.URL) && bodyKey(ba) == bodyKey(bb) &&
			reflect.DeepEqual(fpRefParams(ra.URL.RawQuery), fpRefParams(rb.URL.RawQuery))
		if same != (fa == fb) {
			t.Fatalf("POST %q %q and POST %q %q: the same request: %v, fingerprints equal: %v",
				pa, ba, pb, bb, same, fa == fb)
		}
	})
}

// TestFoldNameIsEqualFold, over every rune: foldName folds two names
// alike exactly when bytes.EqualFold (which encoding/json's matching
// follows) says they are equal. Before foldName followed unicode.SimpleFold
// it folded İ (U+0130) and ı (U+0131) into I, refusing {"i":1,"İ":2},
// which encoding/json reads as two members.
func TestFoldNameIsEqualFold(t *testing.T) {
	for r := rune(0); r <= utf8.MaxRune; r++ {
		if !utf8.ValidRune(r) {
			continue
		}
		s := string(r)
		f := foldName(s)
		if !bytes.EqualFold([]byte(f), []byte(s)) {
			t.Fatalf("foldName(%U) = %q, which bytes.EqualFold tells apart from it", r, f)
		}
		for o := unicode.SimpleFold(r); o != r; o = unicode.SimpleFold(o) {
			if g := foldName(string(o)); g != f {
				t.Fatalf("foldName(%U) = %q, foldName(%U) = %q; bytes.EqualFold says one name", r, f, o, g)
			}
		}
	}
}
