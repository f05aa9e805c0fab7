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
	resp        *idem.Response
}

func encodeEntry(fingerprint string, notAfter time.Time, resp *idem.Response) string {
	n := 32 + len(fingerprint) + len(resp.Body)
	for _, h := range []http.Header{resp.Header, resp.Trailer} {
		for k, vs := range h {
			n += 10 + len(k)
			for _, v := range vs {
				n += 10 + len(v)
			}
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
	b = appendHeader(b, resp.Header)
	b = appendHeader(b, resp.Trailer)
	b = binary.AppendUvarint(b, nilOrLen(resp.Body == nil, len(resp.Body)))
	b = append(b, resp.Body...)
	return string(b)
}

func appendHeader(b []byte, h http.Header) []byte {
	b = binary.AppendUvarint(b, nilOrLen(h == nil, len(h)))
	for k, vs := range h {
		b = appendString(b, k)
		b = binary.AppendUvarint(b, uint64(len(vs)))
		for _, v := range vs {
			b = appendString(b, v)
		}
	}
	return b
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
	if d.err != nil || status > 999 {
		return entry{}, errBadEntry
	}
	h := d.header()
	trailer := d.header()
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
	e.resp = &idem.Response{Status: int(status), Header: h, Body: body, Trailer: trailer}
	return e, nil
}

// header reads what appendHeader wrote.
func (d *decoder) header() http.Header {
	nh := d.uvarint()
	if d.err != nil || nh > uint64(len(d.b))+1 {
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
		if d.err != nil || nv > uint64(len(d.b)) {
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
