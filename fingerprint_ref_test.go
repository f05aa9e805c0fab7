package idem

// The fingerprint as it was before issue 11 (commit 7e789d7), kept
// verbatim under fpRef* names as the reference that the single-pass
// fingerprint must match byte for byte (fingerprint_diff_test.go):
// fpRefFingerprint is FingerprintWithoutQuery's reference. Below it,
// fpRefQueryFingerprint adds the query string as Fingerprint hashes it,
// written the plain way (net/url, sort, one parameter a struct), as
// Fingerprint's reference.

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Fingerprint returns the hex sha256 of the request's method, path (as a
// router sees it: percent-encoding decoded segment by segment) and body.
// A body that is one valid JSON value is canonicalized first, so key order
// and white space do not matter; any other body is hashed as it is.
//
// A JSON body in which one object repeats a member name, exactly or
// differing only in case (as encoding/json compares names), is refused
// with an error wrapping ErrBadBody: decoders disagree on which of the two
// counts (encoding/json keeps the last, matching names without regard to
// case), so two requests that mean different things could share one
// fingerprint.
func fpRefFingerprint(r *http.Request, body []byte) (string, error) {
	if err := fpRefCheckMemberNames(body); err != nil {
		return "", err
	}
	h := sha256.New()
	io.WriteString(h, r.Method)
	h.Write([]byte{0})
	io.WriteString(h, fpRefRoutedPath(r.URL))
	h.Write([]byte{0})
	if c, ok := fpRefCanonicalJSON(body); ok {
		h.Write([]byte{'j'})
		h.Write(c)
	} else {
		h.Write([]byte{'r'})
		h.Write(body)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// routedPath is the path as a router sees it: each segment decoded, so
// that a proxy normalising percent-encoding (/v1/%6Frders) does not make a
// retry another request, with the bytes that would change the segments
// ("/" and "%" inside a segment) escaped again, so that /a%2Fb and /a/b,
// which a router tells apart, stay apart; so do /a/.. and /a/%2E%2E. A path that does not decode is
// used as it came.
func fpRefRoutedPath(u *url.URL) string {
	segs := strings.Split(u.EscapedPath(), "/")
	for i, seg := range segs {
		d, err := url.PathUnescape(seg)
		if err != nil {
			return u.EscapedPath()
		}
		d = fpRefSegmentEscaper.Replace(d)
		if (d == "." || d == "..") && d != seg {
			// An escaped dot segment is a name to a router, which removes
			// (or redirects) only literal ones: keep the two apart.
			d = strings.ReplaceAll(d, ".", "%2E")
		}
		segs[i] = d
	}
	return strings.Join(segs, "/")
}

// NUL is escaped too: it separates the fields Fingerprint hashes, and a
// path holding one (/x%00r, body "") could otherwise hash as another path
// with another body (/x, body "\x00r").
var fpRefSegmentEscaper = strings.NewReplacer("%", "%25", "/", "%2F", "\x00", "%00")

// CheckMemberNames returns a *RepeatedMemberError (matching ErrBadBody)
// when body is JSON and one of its objects, at any depth, repeats a member
// name exactly or differing only in case. Anything that is not JSON
// passes: it is the handler's to refuse.
func fpRefCheckMemberNames(body []byte) error {
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
			return nil //nolint:nilerr // on purpose: the end, or not JSON
		}
		var top *frame
		if len(stack) > 0 {
			top = &stack[len(stack)-1]
		}
		if name, ok := tok.(string); ok && top != nil && top.object && top.wantKey {
			f := fpRefFoldName(name)
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
func fpRefFoldName(name string) string {
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

// fpRefCanonicalJSON re-encodes one JSON value with object keys sorted and no
// insignificant white space. Numbers keep their literal spelling. It reports
// false if b is not exactly one JSON value.
func fpRefCanonicalJSON(b []byte) ([]byte, bool) {
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

// fpRefQueryFingerprint is fpRefFingerprint with the query: method NUL
// routed path NUL, the query's section (none for a query that names no
// parameter), then the body as fpRefFingerprint hashes it.
func fpRefQueryFingerprint(r *http.Request, body []byte) (string, error) {
	if err := fpRefCheckMemberNames(body); err != nil {
		return "", err
	}
	h := sha256.New()
	io.WriteString(h, r.Method)
	h.Write([]byte{0})
	io.WriteString(h, fpRefRoutedPath(r.URL))
	h.Write([]byte{0})
	h.Write(fpRefQuerySection(r.URL.RawQuery))
	if c, ok := fpRefCanonicalJSON(body); ok {
		h.Write([]byte{'j'})
		h.Write(c)
	} else {
		h.Write([]byte{'r'})
		h.Write(body)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// fpRefParam is one parameter of a query: kind 'v' (name=value), 'n' (a
// name without "=") or 'x' (a segment that does not decode, whole in
// name).
type fpRefParam struct {
	kind        byte
	name, value string
}

// fpRefParams reads the query's parameters as Fingerprint does: split at
// "&", empty segments dropped, name and value decoded by
// url.QueryUnescape, a segment with a ";" or a bad escape (both of which
// url.ParseQuery refuses) kept whole; then sorted by name, stably.
func fpRefParams(rawQuery string) []fpRefParam {
	var ps []fpRefParam
	for _, seg := range strings.Split(rawQuery, "&") {
		if seg == "" {
			continue
		}
		p := fpRefParam{kind: 'x', name: seg}
		if !strings.Contains(seg, ";") {
			name, value, pair := strings.Cut(seg, "=")
			n, errN := url.QueryUnescape(name)
			v, errV := url.QueryUnescape(value)
			switch {
			case errN != nil || errV != nil:
			case pair:
				p = fpRefParam{kind: 'v', name: n, value: v}
			default:
				p = fpRefParam{kind: 'n', name: n}
			}
		}
		ps = append(ps, p)
	}
	sort.SliceStable(ps, func(i, j int) bool { return ps[i].name < ps[j].name })
	return ps
}

// fpRefQuerySection is what Fingerprint hashes of a query: nothing when
// it names no parameter, else 'q', the number of parameters, and each
// parameter's kind, name and (for a pair) value, each string after its
// length (uvarints).
func fpRefQuerySection(rawQuery string) []byte {
	ps := fpRefParams(rawQuery)
	if len(ps) == 0 {
		return nil
	}
	var b bytes.Buffer
	uv := func(n int) {
		var x [binary.MaxVarintLen64]byte
		b.Write(x[:binary.PutUvarint(x[:], uint64(n))])
	}
	b.WriteByte('q')
	uv(len(ps))
	for _, p := range ps {
		b.WriteByte(p.kind)
		uv(len(p.name))
		b.WriteString(p.name)
		if p.kind == 'v' {
			uv(len(p.value))
			b.WriteString(p.value)
		}
	}
	return b.Bytes()
}
