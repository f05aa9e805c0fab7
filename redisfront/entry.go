package redisfront

import (
	"encoding/binary"
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/idem-go/idem/idemdriver"
)

// A cache entry is a completed record's response, with the record's
// fingerprint, in a compact binary form:
//
//	version (1 byte) | fingerprint | not after (unix ns, varint) | status |
//	header | trailer | body length+1 | body
//
// where a header (and the trailer) is count+1 | (name | value count |
// values…)…, strings are uvarint length-prefixed, and a count or length
// of 0 stands for a nil header, trailer or body, which a replay keeps
// apart from an empty one. "Not after" is the entry's end by a test clock
// (Options.Now), 0 without one: Redis's PX alone ends an entry in
// production. Entries of an earlier version are not read (the inner
// store decides, and its answer is cached again): version 1 carried the
// record's expiry, which readers compared with their wall clocks, and
// version 2 had no trailers, so one cached by an older instance would
// replay an answer without the trailers its record holds.

const entryVersion = 3

var errBadEntry = errors.New("redisfront: unreadable cache entry")

type entry struct {
	fingerprint string
	notAfter    time.Time // zero: none
	resp        *idemdriver.Response
}

func encodeEntry(fingerprint string, notAfter time.Time, resp *idemdriver.Response) string {
	n := 32 + len(fingerprint) + len(resp.Body)
	for _, h := range [2]http.Header{resp.Header, resp.Trailer} {
		for k, vs := range h {
			n += 10 + len(k)
			for _, v := range vs {
				n += 10 + len(v)
			}
		}
	}
	var e encoder
	e.b.Grow(n) // the entry's one allocation: String does not copy
	e.b.WriteByte(entryVersion)
	e.string(fingerprint)
	var na int64
	if !notAfter.IsZero() {
		na = notAfter.UnixNano()
	}
	e.varint(na)
	e.uvarint(uint64(resp.Status))
	e.header(resp.Header)
	e.header(resp.Trailer)
	e.uvarint(nilOrLen(resp.Body == nil, len(resp.Body)))
	e.b.Write(resp.Body)
	return e.b.String()
}

// encoder writes an entry's fields.
type encoder struct{ b strings.Builder }

func (e *encoder) uvarint(v uint64) {
	var n [binary.MaxVarintLen64]byte
	e.b.Write(binary.AppendUvarint(n[:0], v))
}

func (e *encoder) varint(v int64) {
	var n [binary.MaxVarintLen64]byte
	e.b.Write(binary.AppendVarint(n[:0], v))
}

func (e *encoder) string(s string) {
	e.uvarint(uint64(len(s)))
	e.b.WriteString(s)
}

func (e *encoder) header(h http.Header) {
	e.uvarint(nilOrLen(h == nil, len(h)))
	for k, vs := range h {
		e.string(k)
		e.uvarint(uint64(len(vs)))
		for _, v := range vs {
			e.string(v)
		}
	}
}

func nilOrLen(isNil bool, n int) uint64 {
	if isNil {
		return 0
	}
	return uint64(n) + 1
}

// decodeEntry reads an entry from s without copying it: the strings of
// the header and trailer are parts of s; only the body is copied (a
// Response's body is a []byte).
func decodeEntry(s string) (entry, error) {
	d := decoder{s: s}
	if len(d.s) == 0 || d.s[0] != entryVersion {
		return entry{}, errBadEntry
	}
	d.s = d.s[1:]
	var e entry
	e.fingerprint = d.string()
	if na := d.varint(); na != 0 {
		e.notAfter = time.Unix(0, na)
	}
	status := d.uvarint()
	// The middleware stores final answers only: a status under 200 (or
	// over 999) is not one, so the entry is corrupt or not ours.
	if d.err != nil || status < 200 || status > 999 {
		return entry{}, errBadEntry
	}
	h := d.header()
	trailer := d.header()
	nb := d.uvarint()
	if d.err != nil || nb != uint64(len(d.s))+1 && !(nb == 0 && len(d.s) == 0) {
		return entry{}, errBadEntry
	}
	var body []byte
	if nb > 0 {
		body = make([]byte, len(d.s))
		copy(body, d.s)
	}
	e.resp = &idemdriver.Response{Status: int(status), Header: h, Body: body, Trailer: trailer}
	return e, nil
}

// header reads what encoder.header wrote.
func (d *decoder) header() http.Header {
	nh := d.uvarint()
	if d.err != nil || nh > uint64(len(d.s))+1 {
		d.err = errBadEntry
		return nil
	}
	var h http.Header
	if nh > 0 {
		h = make(http.Header, nh-1)
	}
	for range max(nh, 1) - 1 {
		k := d.string()
		nv := d.uvarint()
		if d.err != nil || nv > uint64(len(d.s)) {
			d.err = errBadEntry
			return nil
		}
		vs := make([]string, 0, nv)
		for range nv {
			vs = append(vs, d.string())
		}
		h[k] = vs
	}
	return h
}

// decoder reads an entry's fields from the front of s.
type decoder struct {
	s   string
	err error
}

// uvarint reads what binary.AppendUvarint wrote, refusing what
// binary.Uvarint refuses (a truncated or overflowing value).
func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	var x uint64
	var shift uint
	for i := 0; i < len(d.s) && i < binary.MaxVarintLen64; i++ {
		b := d.s[i]
		if b < 0x80 {
			if i == binary.MaxVarintLen64-1 && b > 1 {
				break // overflows 64 bits
			}
			d.s = d.s[i+1:]
			return x | uint64(b)<<shift
		}
		x |= uint64(b&0x7f) << shift
		shift += 7
	}
	d.err = errBadEntry
	return 0
}

// varint reads what binary.AppendVarint wrote.
func (d *decoder) varint() int64 {
	ux := d.uvarint()
	x := int64(ux >> 1)
	if ux&1 != 0 {
		x = ^x
	}
	return x
}

func (d *decoder) string() string {
	n := d.uvarint()
	if d.err != nil {
		return ""
	}
	if n > uint64(len(d.s)) {
		d.err = errBadEntry
		return ""
	}
	v := d.s[:n]
	d.s = d.s[n:]
	return v
}
