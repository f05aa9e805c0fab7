package redisfront

import (
	"encoding/binary"
	"errors"
	"net/http"
	"slices"
	"time"

	"github.com/idem-go/idem"
)

// A cache entry is a completed record's response, with the record's
// fingerprint, in a compact binary form:
//
//	version (1 byte) | fingerprint | not after (unix ns, varint) | status |
//	header count+1 | (name | value count | values…)… | body length+1 | body
//
// where strings are uvarint length-prefixed, and a count or length of 0
// stands for a nil header or body, which a replay keeps apart from an
// empty one. "Not after" is the entry's end by a test clock
// (Options.Now), 0 without one: Redis's PX alone ends an entry in
// production. Version 1 entries carried the record's expiry, which
// readers compared with their wall clocks; they are not read (the inner
// store decides, and its answer is cached again).

const entryVersion = 2

var errBadEntry = errors.New("redisfront: unreadable cache entry")

type entry struct {
	fingerprint string
	notAfter    time.Time // zero: none
	resp        *idem.Response
}

func encodeEntry(fingerprint string, notAfter time.Time, resp *idem.Response) string {
	n := 32 + len(fingerprint) + len(resp.Body)
	for k, vs := range resp.Header {
		n += 10 + len(k)
		for _, v := range vs {
			n += 10 + len(v)
		}
	}
	b := make([]byte, 0, n)
	b = append(b, entryVersion)
	b = appendString(b, fingerprint)
	var na int64
	if !notAfter.IsZero() {
		na = notAfter.UnixNano()
	}
	b = binary.AppendVarint(b, na)
	b = binary.AppendUvarint(b, uint64(resp.Status))
	b = binary.AppendUvarint(b, nilOrLen(resp.Header == nil, len(resp.Header)))
	for k, vs := range resp.Header {
		b = appendString(b, k)
		b = binary.AppendUvarint(b, uint64(len(vs)))
		for _, v := range vs {
			b = appendString(b, v)
		}
	}
	b = binary.AppendUvarint(b, nilOrLen(resp.Body == nil, len(resp.Body)))
	b = append(b, resp.Body...)
	return string(b)
}

func nilOrLen(isNil bool, n int) uint64 {
	if isNil {
		return 0
	}
	return uint64(n) + 1
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

func decodeEntry(s string) (entry, error) {
	d := decoder{b: []byte(s)}
	if len(d.b) == 0 || d.b[0] != entryVersion {
		return entry{}, errBadEntry
	}
	d.b = d.b[1:]
	var e entry
	e.fingerprint = d.string()
	if na := d.varint(); na != 0 {
		e.notAfter = time.Unix(0, na)
	}
	status := d.uvarint()
	nh := d.uvarint()
	if d.err != nil || status > 999 || nh > uint64(len(d.b))+1 {
		return entry{}, errBadEntry
	}
	var h http.Header
	if nh > 0 {
		h = make(http.Header, nh-1)
	}
	for range max(nh, 1) - 1 {
		k := d.string()
		nv := d.uvarint()
		if d.err != nil || nv > uint64(len(d.b)) {
			return entry{}, errBadEntry
		}
		vs := make([]string, 0, nv)
		for range nv {
			vs = append(vs, d.string())
		}
		h[k] = vs
	}
	nb := d.uvarint()
	if d.err != nil || nb != uint64(len(d.b))+1 && !(nb == 0 && len(d.b) == 0) {
		return entry{}, errBadEntry
	}
	var body []byte
	if nb > 0 {
		body = slices.Clone(d.b)
		if body == nil {
			body = []byte{}
		}
	}
	e.resp = &idem.Response{Status: int(status), Header: h, Body: body}
	return e, nil
}

type decoder struct {
	b   []byte
	err error
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.err = errBadEntry
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b)
	if n <= 0 {
		d.err = errBadEntry
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) string() string {
	n := d.uvarint()
	if d.err != nil {
		return ""
	}
	if n > uint64(len(d.b)) {
		d.err = errBadEntry
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}
