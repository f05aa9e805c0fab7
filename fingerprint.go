package idem

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"net/http"
	"net/url"
	"slices"
	"strings"
)

// Fingerprint returns the hex sha256 of the request's method, path (as a
// router sees it: percent-encoding decoded segment by segment), query
// string and body. A body that is one valid JSON value is canonicalized
// first, so key order and white space do not matter; any other body is
// hashed as it is.
//
// The query is hashed as the parameters a handler reads from it
// (url.ParseQuery, r.URL.Query, r.FormValue), in a canonical form: split
// at "&", empty segments dropped, each segment split at its first "="
// into a name and a value and both percent-decoded, "+" decoded as a
// space (as HTML forms and url.QueryUnescape do: a=b+c and a=b%20c are
// one request, a=b%2Bc another), then the parameters sorted by name,
// the values of one name kept in the order they came. A segment without
// "=" (a) is not one with an empty value (a=). A segment that does not
// decode (a bad escape such as %zz, or a literal ";", which
// url.ParseQuery refuses) is kept as it came and sorted as a name of its
// own. A request whose query is empty, or only "&"s, has the fingerprint
// it had before the query was hashed, and that FingerprintWithoutQuery
// gives.
//
// A JSON body in which one object repeats a member name, exactly or
// differing only in case (as encoding/json compares names), is refused
// with an error wrapping ErrBadBody: decoders disagree on which of the two
// counts (encoding/json keeps the last, matching names without regard to
// case), so two requests that mean different things could share one
// fingerprint.
func Fingerprint(r *http.Request, body []byte) (string, error) {
	return fingerprint(r, body, true)
}

// FingerprintWithoutQuery is Fingerprint without the query string:
// method, routed path and body only, the default fingerprint of releases
// before the query was hashed. Set it as Options.Fingerprint for an API
// whose handlers read no query on the requests the middleware guards, so
// that a query a client or a proxy adds (a tracking parameter) does not
// make a retry another request. Where a query changes what a request
// does (?dry_run=true), leaving it out replays one request's answer to
// the other.
func FingerprintWithoutQuery(r *http.Request, body []byte) (string, error) {
	return fingerprint(r, body, false)
}

func fingerprint(r *http.Request, body []byte, withQuery bool) (string, error) {
	c := fpGet()
	defer fpPut(c)
	isJSON := c.run(body)
	if !isJSON {
		// Not one JSON value, a repeated name, or too deep for the single
		// pass: decide as before, with encoding/json.
		if err := fpSlowCheckMemberNames(body); err != nil {
			return "", err
		}
	}
	// method NUL path NUL, then the query ('q' and its parameters) unless
	// it names none, then 'j' and the canonical form or 'r' and the body
	// as it came. Without a query the bytes are those hashed before the
	// query was, so that stored keys keep their fingerprints.
	pre := append(c.pre[:0], r.Method...)
	pre = append(pre, 0)
	pre = append(pre, routedPath(r.URL)...)
	pre = append(pre, 0)
	if withQuery && r.URL.RawQuery != "" {
		pre = c.appendQuery(pre, r.URL.RawQuery)
	}
	// The tag is appended to pre itself, kept in c.pre: appended to a
	// copy of pre whose capacity it fills, it cost an allocation a call.
	h := c.h
	h.Reset()
	if isJSON {
		pre = append(pre, 'j')
		h.Write(pre)
		h.Write(c.out)
	} else if s, ok := fpSlowCanonicalJSON(body); ok {
		pre = append(pre, 'j')
		h.Write(pre)
		h.Write(s)
	} else {
		pre = append(pre, 'r')
		h.Write(pre)
		h.Write(body)
	}
	c.pre = pre
	c.sum = h.Sum(c.sum[:0])
	var x [2 * sha256.Size]byte
	hex.Encode(x[:], c.sum)
	return string(x[:]), nil
}

// The kinds of a query parameter in the hashed form.
const (
	fpQueryPair = 'v' // name=value, both decoded
	fpQueryName = 'n' // a name without "=", decoded
	fpQueryRaw  = 'x' // a segment that does not decode, as it came
)

// fpParam is one parameter of the query: its kind and the offsets of its
// name and value in fpCanon.q.
type fpParam struct {
	kind                       byte
	name, nameEnd, val, valEnd int
}

// appendQuery appends to dst the canonical form of the query q (see
// Fingerprint) in a form that no other query, and no body, shares: 'q',
// the number of parameters, then for each its kind and its name (and for
// a pair its value), each prefixed with its length, so that a=b&c and
// a=b%26c stay apart. A query that names no parameter appends nothing.
func (c *fpCanon) appendQuery(dst []byte, q string) []byte {
	c.q, c.params = c.q[:0], c.params[:0]
	for q != "" {
		var seg string
		seg, q, _ = strings.Cut(q, "&")
		if seg != "" {
			c.params = append(c.params, c.param(seg))
		}
	}
	if len(c.params) == 0 {
		return dst
	}
	ps := c.params
	name := func(p fpParam) []byte { return c.q[p.name:p.nameEnd] }
	for i := 1; i < len(ps); i++ {
		if bytes.Compare(name(ps[i-1]), name(ps[i])) > 0 {
			slices.SortStableFunc(ps, func(a, b fpParam) int { return bytes.Compare(name(a), name(b)) })
			break
		}
	}
	dst = append(dst, 'q')
	dst = binary.AppendUvarint(dst, uint64(len(ps)))
	for _, p := range ps {
		dst = append(dst, p.kind)
		dst = binary.AppendUvarint(dst, uint64(p.nameEnd-p.name))
		dst = append(dst, c.q[p.name:p.nameEnd]...)
		if p.kind == fpQueryPair {
			dst = binary.AppendUvarint(dst, uint64(p.valEnd-p.val))
			dst = append(dst, c.q[p.val:p.valEnd]...)
		}
	}
	return dst
}

// param decodes the query segment seg (not empty) into c.q.
func (c *fpCanon) param(seg string) fpParam {
	start := len(c.q)
	if strings.IndexByte(seg, ';') < 0 {
		name, value, isPair := strings.Cut(seg, "=")
		p := fpParam{kind: fpQueryName, name: start}
		var ok bool
		if c.q, ok = fpAppendQueryUnescape(c.q, name); ok {
			p.nameEnd, p.val = len(c.q), len(c.q)
			if isPair {
				p.kind = fpQueryPair
				c.q, ok = fpAppendQueryUnescape(c.q, value)
			}
			p.valEnd = len(c.q)
			if ok {
				return p
			}
		}
		c.q = c.q[:start]
	}
	c.q = append(c.q, seg...)
	return fpParam{kind: fpQueryRaw, name: start, nameEnd: len(c.q), val: len(c.q), valEnd: len(c.q)}
}

// fpAppendQueryUnescape appends s decoded as url.QueryUnescape decodes
// it ("+" a space, %XX a byte) to dst; it reports false, with dst cut
// back or not, if s holds a "%" not followed by two hex digits.
func fpAppendQueryUnescape(dst []byte, s string) ([]byte, bool) {
	for i := 0; i < len(s); i++ {
		switch b := s[i]; b {
		case '%':
			if i+2 >= len(s) {
				return dst, false
			}
			hi, ok1 := fpUnhex(s[i+1])
			lo, ok2 := fpUnhex(s[i+2])
			if !ok1 || !ok2 {
				return dst, false
			}
			dst = append(dst, hi<<4|lo)
			i += 2
		case '+':
			dst = append(dst, ' ')
		default:
			dst = append(dst, b)
		}
	}
	return dst, true
}

func fpUnhex(b byte) (byte, bool) {
	switch {
	case '0' <= b && b <= '9':
		return b - '0', true
	case 'a' <= b && b <= 'f':
		return b - 'a' + 10, true
	case 'A' <= b && b <= 'F':
		return b - 'A' + 10, true
	}
	return 0, false
}

// routedPath is the path as a router sees it: each segment decoded, so
// that a proxy normalising percent-encoding (/v1/%6Frders) does not make a
// retry another request, with the bytes that would change the segments
// ("/" and "%" inside a segment) escaped again, so that /a%2Fb and /a/b,
// which a router tells apart, stay apart; so do /a/.. and /a/%2E%2E. A path that does not decode is
// used as it came.
func routedPath(u *url.URL) string {
	ep := u.EscapedPath()
	if !strings.Contains(ep, "%") {
		// Nothing to decode: every segment stays as it is (it holds no
		// "%", "/" or NUL to escape again, and is a dot segment only if
		// it was one).
		return ep
	}
	segs := strings.Split(ep, "/")
	for i, seg := range segs {
		d, err := url.PathUnescape(seg)
		if err != nil {
			return u.EscapedPath()
		}
		d = segmentEscaper.Replace(d)
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
var segmentEscaper = strings.NewReplacer("%", "%25", "/", "%2F", "\x00", "%00")
