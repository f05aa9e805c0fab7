package idem

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"hash"
	"io"
	"slices"
	"strings"
	"sync"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// RepeatedMemberError reports a member name that one object of a JSON
// body repeats, exactly or differing only in case. It matches ErrBadBody.
type RepeatedMemberError struct {
	Name string // the second spelling met
}

func (e *RepeatedMemberError) Error() string {
	return fmt.Sprintf("the member name %q appears twice in one object (names are compared without regard to case)", e.Name)
}

// Is makes a RepeatedMemberError match ErrBadBody.
func (e *RepeatedMemberError) Is(target error) bool { return target == ErrBadBody }

// CheckMemberNames returns a *RepeatedMemberError (matching ErrBadBody)
// when body is JSON and one of its objects, at any depth, repeats a member
// name exactly or differing only in case. Anything that is not JSON
// passes: it is the handler's to refuse.
func CheckMemberNames(body []byte) error {
	c := fpGet()
	ok := c.run(body)
	fpPut(c)
	if ok {
		return nil
	}
	return fpSlowCheckMemberNames(body)
}

// fpSlowCheckMemberNames is CheckMemberNames with encoding/json's tokens:
// it decides every body the single pass leaves (not one JSON value, a
// repeated name, deep nesting), in the same order as before.
func fpSlowCheckMemberNames(body []byte) error {
	type frame struct {
		object  bool
		wantKey bool // the next token of this object is a member name
		names   map[string]struct{}
	}
	var stack []frame
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	for {
		tok, err := dec.Token()
		if err != nil {
			return nil //nolint:nilerr // the end, or not JSON: only a repeated member name is reported; a body that is not JSON is the handler's to refuse
		}
		var top *frame
		if len(stack) > 0 {
			top = &stack[len(stack)-1]
		}
		if name, ok := tok.(string); ok && top != nil && top.object && top.wantKey {
			f := foldName(name)
			if _, dup := top.names[f]; dup {
				return &RepeatedMemberError{Name: name}
			}
			top.names[f] = struct{}{}
			top.wantKey = false
			continue
		}
		switch tok {
		case json.Delim('{'):
			stack = append(stack, frame{object: true, wantKey: true, names: make(map[string]struct{})})
		case json.Delim('['):
			stack = append(stack, frame{})
		case json.Delim('}'), json.Delim(']'):
			stack = stack[:len(stack)-1]
			if len(stack) > 0 && stack[len(stack)-1].object {
				stack[len(stack)-1].wantKey = true
			}
		default:
			if top != nil && top.object {
				top.wantKey = true
			}
		}
	}
}

// foldName folds name the way encoding/json matches member names to
// fields: two names fold alike exactly when bytes.EqualFold says so. Each
// rune becomes the smallest of its unicode.SimpleFold orbit, as in
// encoding/json (ToUpper(ToLower(r)) would also fold İ and ı into I, which
// encoding/json keeps apart).
func foldName(name string) string {
	var b strings.Builder
	b.Grow(len(name))
	for _, r := range name {
		if r < utf8.RuneSelf {
			if 'a' <= r && r <= 'z' {
				r -= 'a' - 'A'
			}
			b.WriteRune(r)
			continue
		}
		for {
			r2 := unicode.SimpleFold(r)
			if r2 <= r {
				r = r2
				break
			}
			r = r2
		}
		b.WriteRune(r)
	}
	return b.String()
}

// canonicalJSON re-encodes one JSON value with object keys sorted and no
// insignificant white space. Numbers keep their literal spelling. It reports
// false if b is not exactly one JSON value.
func canonicalJSON(b []byte) ([]byte, bool) {
	c := fpGet()
	defer fpPut(c)
	if c.run(b) {
		return bytes.Clone(c.out), true
	}
	return fpSlowCanonicalJSON(b)
}

// fpSlowCanonicalJSON is canonicalJSON with encoding/json: decode, then
// Marshal (which sorts map keys).
func fpSlowCanonicalJSON(b []byte) ([]byte, bool) {
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

// The single pass (issue 11): one walk over the body that decides whether
// it is exactly one JSON value as encoding/json's Decoder does (followed
// by nothing but white space), checks member names as CheckMemberNames
// does, and writes the form json.Marshal gives the decoded value (map keys
// sorted by their decoded bytes, strings escaped as Marshal escapes them,
// numbers as written). It answers only when it is sure: any body that is
// not JSON, repeats a name, or nests deeper than fpMaxDepth is left to the
// encoding/json path, which decides it as before.

// fpMaxDepth bounds the nesting the single pass takes (encoding/json's
// own limit is 10000): deeper bodies go the encoding/json way.
const fpMaxDepth = 200

// fpMember is one member of an object being read: offsets of its decoded
// name and folded name in fpCanon.keys, and of its canonical bytes
// ("name":value) in fpCanon.out.
type fpMember struct {
	key, keyEnd, fold, foldEnd, seg, segEnd int
}

// fpCanon holds the single pass's buffers; pooled.
type fpCanon struct {
	in      []byte
	pos     int
	out     []byte // canonical form
	keys    []byte // decoded and folded names of the open objects; string scratch
	tmp     []byte
	members []fpMember // members of the open objects
	byFold  []fpMember
	pre     []byte    // what Fingerprint hashes before the body
	q       []byte    // the query's decoded names and values
	params  []fpParam // the query's parameters
	h       hash.Hash
	sum     []byte
}

var fpPool = sync.Pool{New: func() any { return &fpCanon{h: sha256.New()} }}

func fpGet() *fpCanon { return fpPool.Get().(*fpCanon) }

func fpPut(c *fpCanon) {
	c.in = nil
	if cap(c.out) > 1<<16 || cap(c.keys) > 1<<16 || cap(c.tmp) > 1<<16 || cap(c.pre) > 1<<16 || cap(c.members) > 1<<12 || cap(c.byFold) > 1<<12 ||
		cap(c.q) > 1<<16 || cap(c.params) > 1<<12 {
		return // do not keep a huge body's buffers
	}
	fpPool.Put(c)
}

// run reports whether body is exactly one JSON value with no repeated
// member names; if so, c.out holds its canonical form.
func (c *fpCanon) run(body []byte) bool {
	c.in, c.pos = body, 0
	c.out, c.keys, c.members = c.out[:0], c.keys[:0], c.members[:0]
	c.skipSpace()
	if !c.value(0) {
		return false
	}
	c.skipSpace()
	return c.pos == len(c.in)
}

// skipSpace skips JSON's white space (and only it: not \v, \f, NBSP...).
func (c *fpCanon) skipSpace() {
	for c.pos < len(c.in) {
		switch c.in[c.pos] {
		case ' ', '\t', '\n', '\r':
			c.pos++
		default:
			return
		}
	}
}

func (c *fpCanon) value(depth int) bool {
	if c.pos >= len(c.in) {
		return false
	}
	switch c.in[c.pos] {
	case '{':
		return depth < fpMaxDepth && c.object(depth+1)
	case '[':
		return depth < fpMaxDepth && c.array(depth+1)
	case '"':
		start := len(c.keys)
		if !c.str() {
			return false
		}
		c.out = fpAppendString(c.out, c.keys[start:])
		c.keys = c.keys[:start]
		return true
	case 't':
		return c.literal("true")
	case 'f':
		return c.literal("false")
	case 'n':
		return c.literal("null")
	}
	return c.number()
}

func (c *fpCanon) literal(lit string) bool {
	if !bytes.HasPrefix(c.in[c.pos:], []byte(lit)) {
		return false
	}
	c.pos += len(lit)
	c.out = append(c.out, lit...)
	return true
}

func fpDigit(b byte) bool { return '0' <= b && b <= '9' }

// number copies a number literal as written: the decoder keeps it as a
// json.Number and Marshal writes a json.Number's text unchanged.
func (c *fpCanon) number() bool {
	in, i := c.in, c.pos
	if i < len(in) && in[i] == '-' {
		i++
	}
	switch {
	case i >= len(in):
		return false
	case in[i] == '0':
		i++
	case '1' <= in[i] && in[i] <= '9':
		for i++; i < len(in) && fpDigit(in[i]); i++ {
		}
	default:
		return false
	}
	if i < len(in) && in[i] == '.' {
		i++
		if i >= len(in) || !fpDigit(in[i]) {
			return false
		}
		for i++; i < len(in) && fpDigit(in[i]); i++ {
		}
	}
	if i < len(in) && (in[i] == 'e' || in[i] == 'E') {
		i++
		if i < len(in) && (in[i] == '+' || in[i] == '-') {
			i++
		}
		if i >= len(in) || !fpDigit(in[i]) {
			return false
		}
		for i++; i < len(in) && fpDigit(in[i]); i++ {
		}
	}
	c.out = append(c.out, in[c.pos:i]...)
	c.pos = i
	return true
}

// str reads the string at c.pos and appends its decoded bytes to c.keys,
// as encoding/json decodes it: invalid UTF-8 and lone or mismatched
// surrogate escapes become U+FFFD.
func (c *fpCanon) str() bool {
	in := c.in
	i := c.pos + 1
	for {
		start := i
		for i < len(in) && in[i] >= ' ' && in[i] < utf8.RuneSelf && in[i] != '"' && in[i] != '\\' {
			i++
		}
		c.keys = append(c.keys, in[start:i]...)
		if i >= len(in) {
			return false
		}
		switch b := in[i]; {
		case b == '"':
			c.pos = i + 1
			return true
		case b < ' ':
			return false
		case b == '\\':
			if i+1 >= len(in) {
				return false
			}
			switch e := in[i+1]; e {
			case '"', '\\', '/':
				c.keys = append(c.keys, e)
			case 'b':
				c.keys = append(c.keys, '\b')
			case 'f':
				c.keys = append(c.keys, '\f')
			case 'n':
				c.keys = append(c.keys, '\n')
			case 'r':
				c.keys = append(c.keys, '\r')
			case 't':
				c.keys = append(c.keys, '\t')
			case 'u':
				rr := fpU4(in[i:])
				if rr < 0 {
					return false
				}
				i += 6
				if utf16.IsSurrogate(rr) {
					if d := utf16.DecodeRune(rr, fpU4(in[i:])); d != unicode.ReplacementChar {
						c.keys = utf8.AppendRune(c.keys, d)
						i += 6
						continue
					}
					rr = unicode.ReplacementChar
				}
				c.keys = utf8.AppendRune(c.keys, rr)
				continue
			default:
				return false
			}
			i += 2
		default:
			r, size := utf8.DecodeRune(in[i:])
			c.keys = utf8.AppendRune(c.keys, r)
			i += size
		}
	}
}

// fpU4 decodes the \uXXXX escape at the start of s, or returns -1.
func fpU4(s []byte) rune {
	if len(s) < 6 || s[0] != '\\' || s[1] != 'u' {
		return -1
	}
	var r rune
	for _, b := range s[2:6] {
		switch {
		case '0' <= b && b <= '9':
			b -= '0'
		case 'a' <= b && b <= 'f':
			b = b - 'a' + 10
		case 'A' <= b && b <= 'F':
			b = b - 'A' + 10
		default:
			return -1
		}
		r = r*16 + rune(b)
	}
	return r
}

func (c *fpCanon) array(depth int) bool {
	c.pos++
	c.out = append(c.out, '[')
	c.skipSpace()
	if c.pos < len(c.in) && c.in[c.pos] == ']' {
		c.pos++
		c.out = append(c.out, ']')
		return true
	}
	for {
		if !c.value(depth) {
			return false
		}
		c.skipSpace()
		if c.pos >= len(c.in) {
			return false
		}
		switch c.in[c.pos] {
		case ',':
			c.pos++
			c.out = append(c.out, ',')
			c.skipSpace()
		case ']':
			c.pos++
			c.out = append(c.out, ']')
			return true
		default:
			return false
		}
	}
}

func (c *fpCanon) object(depth int) bool {
	c.pos++
	c.out = append(c.out, '{')
	body := len(c.out)
	base, keyBase := len(c.members), len(c.keys)
	c.skipSpace()
	if c.pos < len(c.in) && c.in[c.pos] == '}' {
		c.pos++
		c.out = append(c.out, '}')
		return true
	}
	for {
		if c.pos >= len(c.in) || c.in[c.pos] != '"' {
			return false
		}
		k := len(c.keys)
		if !c.str() {
			return false
		}
		ke := len(c.keys)
		c.keys = fpAppendFold(c.keys, c.keys[k:ke])
		fe := len(c.keys)
		c.skipSpace()
		if c.pos >= len(c.in) || c.in[c.pos] != ':' {
			return false
		}
		c.pos++
		c.skipSpace()
		if len(c.members) > base {
			c.out = append(c.out, ',')
		}
		seg := len(c.out)
		c.out = fpAppendString(c.out, c.keys[k:ke])
		c.out = append(c.out, ':')
		if !c.value(depth) {
			return false
		}
		c.members = append(c.members, fpMember{k, ke, ke, fe, seg, len(c.out)})
		c.skipSpace()
		if c.pos >= len(c.in) {
			return false
		}
		if c.in[c.pos] == '}' {
			c.pos++
			break
		}
		if c.in[c.pos] != ',' {
			return false
		}
		c.pos++
		c.skipSpace()
	}
	ms := c.members[base:]
	if c.repeated(ms) {
		return false
	}
	key := func(m fpMember) []byte { return c.keys[m.key:m.keyEnd] }
	sorted := true
	for i := 1; i < len(ms) && sorted; i++ {
		sorted = bytes.Compare(key(ms[i-1]), key(ms[i])) < 0
	}
	if !sorted {
		// As Marshal sorts a map's keys: by the decoded name's bytes.
		c.tmp = append(c.tmp[:0], c.out[body:]...)
		slices.SortFunc(ms, func(a, b fpMember) int { return bytes.Compare(key(a), key(b)) })
		c.out = c.out[:body]
		for i, m := range ms {
			if i > 0 {
				c.out = append(c.out, ',')
			}
			c.out = append(c.out, c.tmp[m.seg-body:m.segEnd-body]...)
		}
	}
	c.out = append(c.out, '}')
	c.members, c.keys = c.members[:base], c.keys[:keyBase]
	return true
}

// repeated reports whether two of ms have names that fold alike.
func (c *fpCanon) repeated(ms []fpMember) bool {
	fold := func(m fpMember) []byte { return c.keys[m.fold:m.foldEnd] }
	if len(ms) <= 8 {
		for i := 1; i < len(ms); i++ {
			for j := 0; j < i; j++ {
				if bytes.Equal(fold(ms[i]), fold(ms[j])) {
					return true
				}
			}
		}
		return false
	}
	c.byFold = append(c.byFold[:0], ms...)
	slices.SortFunc(c.byFold, func(a, b fpMember) int { return bytes.Compare(fold(a), fold(b)) })
	for i := 1; i < len(c.byFold); i++ {
		if bytes.Equal(fold(c.byFold[i-1]), fold(c.byFold[i])) {
			return true
		}
	}
	return false
}

// fpAppendFold appends foldName(string(name)) to dst; name is valid UTF-8
// (a decoded JSON string always is).
func fpAppendFold(dst, name []byte) []byte {
	for i := 0; i < len(name); {
		if b := name[i]; b < utf8.RuneSelf {
			if 'a' <= b && b <= 'z' {
				b -= 'a' - 'A'
			}
			dst = append(dst, b)
			i++
			continue
		}
		r, size := utf8.DecodeRune(name[i:])
		i += size
		for {
			r2 := unicode.SimpleFold(r)
			if r2 <= r {
				r = r2
				break
			}
			r = r2
		}
		dst = utf8.AppendRune(dst, r)
	}
	return dst
}

// fpHTMLSafe is encoding/json's htmlSafeSet: the ASCII bytes Marshal
// writes as they are.
var fpHTMLSafe = func() (t [utf8.RuneSelf]bool) {
	for b := ' '; b < utf8.RuneSelf; b++ {
		t[b] = b != '"' && b != '\\' && b != '<' && b != '>' && b != '&'
	}
	return t
}()

const fpHex = "0123456789abcdef"

// fpAppendString appends s quoted as json.Marshal quotes a string (with
// HTML escaping, as Marshal does).
func fpAppendString(dst, s []byte) []byte {
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		if b := s[i]; b < utf8.RuneSelf {
			if fpHTMLSafe[b] {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch b {
			case '\\', '"':
				dst = append(dst, '\\', b)
			case '\b':
				dst = append(dst, '\\', 'b')
			case '\f':
				dst = append(dst, '\\', 'f')
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', fpHex[b>>4], fpHex[b&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRune(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			dst = append(dst, s[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', fpHex[r&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
