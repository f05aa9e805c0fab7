package memstore

// Completed records are kept encoded, each in one run of bytes of an
// arena of large pointer-free chunks, and found through a map from a hash
// of (user, key) to the run's place: neither the map nor the chunks hold
// a pointer, so the garbage collector has nothing to scan in them however
// many records the store holds. (A record as a tree of strings, maps and
// slices per key made every collection scan every record: the
// middleware's cost grew with the store.) Records in flight, which
// change, stay as *entry in Store.recs.
//
// A record's bytes are
//
//	[0:4]   uint32 length of the whole record
//	[4:12]  int64  Attempts
//	[12:20] int64  Redrives
//	[20:28] int64  Response.Status
//	[28:92] LeaseUntil, CreatedAt, CompletedAt, ExpiresAt: each int64
//	        Unix seconds, uint32 nanoseconds, uint32 location (Store.locs)
//	then fields, each a uvarint n+1 and n bytes, 0 for a nil one:
//	User, Key, Fingerprint, Response.Header, Response.Body,
//	Response.Trailer, Method, Path, Owner, Header, Body
//
// A header's n bytes are a uvarint count of names, then, by name in
// order, the name (uvarint length, bytes) and its values (uvarint count+1,
// 0 for nil, then each as uvarint length, bytes). All integers little
// endian. Times keep their instant and location, not a monotonic reading.

import (
	"bytes"
	"encoding/binary"
	"hash/maphash"
	"math/bits"
	"net/http"
	"slices"
	"time"

	"github.com/idem-go/idem/idemdriver"
)

// Offsets of the fixed part of an encoded record.
const (
	offAttempts    = 4
	offRedrives    = 12
	offStatus      = 20
	offLeaseUntil  = 28
	offCreatedAt   = 44
	offCompletedAt = 60
	offExpiresAt   = 76
	fixedLen       = 92
)

// slot is where a completed record's bytes begin in the arena.
type slot struct{ chunk, off uint32 }

// Chunk sizes of the arena: a store starts small and grows its chunks
// to maxChunk; a record longer than a quarter of that gets a chunk of
// its own.
const (
	minChunk = 4 << 10
	maxChunk = 1 << 20
)

// arena holds the encoded completed records in chunks that are only
// appended to. A chunk whose live bytes fall under a quarter of its
// length, the one appended to apart, has its live records moved to the
// one appended to (Store.compact) and is dropped.
type arena struct {
	chunks [][]byte // nil: a free index
	live   []int    // live bytes per chunk
	cur    int      // the chunk appended to, -1 before the first
	next   int      // the size of the next chunk made
	free   []int    // free indexes of chunks
}

// put copies the encoded record b into the arena and returns its slot.
func (a *arena) put(b []byte) slot {
	i := a.cur
	switch {
	case len(b) > maxChunk/4:
		i = a.chunk(len(b)) // a chunk of its own
	case i < 0 || len(a.chunks[i])+len(b) > cap(a.chunks[i]):
		if i >= 0 && a.live[i] == 0 {
			// Its records were all dropped while it was the one appended
			// to, when drop does not compact: no later drop will free it.
			a.chunks[i] = nil
			a.free = append(a.free, i)
		}
		i = a.chunk(max(a.next, minChunk))
		a.next = min(2*max(a.next, minChunk), maxChunk)
		a.cur = i
	}
	c := a.chunks[i]
	sl := slot{uint32(i), uint32(len(c))}
	a.chunks[i] = append(c, b...)
	a.live[i] += len(b)
	return sl
}

// chunk makes a chunk of size bytes and returns its index.
func (a *arena) chunk(size int) int {
	i := len(a.chunks)
	if n := len(a.free); n > 0 {
		i, a.free = a.free[n-1], a.free[:n-1]
	} else {
		a.chunks, a.live = append(a.chunks, nil), append(a.live, 0)
	}
	a.chunks[i], a.live[i] = make([]byte, 0, size), 0
	return i
}

// get returns the bytes of the record at sl: the arena's own, not a copy.
func (a *arena) get(sl slot) []byte {
	c := a.chunks[sl.chunk][sl.off:]
	n := binary.LittleEndian.Uint32(c)
	return c[:n:n]
}

// drop forgets the record at sl and reports whether its chunk should now
// be compacted.
func (a *arena) drop(sl slot) bool {
	i := int(sl.chunk)
	a.live[i] -= len(a.get(sl))
	return i != a.cur && a.live[i]*4 < len(a.chunks[i])
}

// hash is the key of k's completed record in Store.done.
func (s *Store) hash(k id) uint64 {
	return (bits.RotateLeft64(maphash.String(s.seed, k.user), 17) ^ maphash.String(s.seed, k.key)) & s.mask
}

// findDone returns the slot of k's completed record, if the store holds
// one, and k's hash. Callers hold s.mu.
func (s *Store) findDone(k id) (slot, uint64, bool) {
	h := s.hash(k)
	if sl, ok := s.done[h]; ok {
		r := rd{b: s.arena.get(sl), i: fixedLen}
		if r.fieldIs(k.user) && r.fieldIs(k.key) {
			return sl, h, true
		}
	}
	if len(s.clash) > 0 {
		if sl, ok := s.clash[k]; ok {
			return sl, h, true
		}
	}
	return slot{}, h, false
}

// insertDone records that k's completed record, of hash h, is at sl.
// The store holds no other completed record of k. Callers hold s.mu.
func (s *Store) insertDone(k id, h uint64, sl slot) {
	if _, taken := s.done[h]; !taken {
		s.done[h] = sl
		return
	}
	if s.clash == nil {
		s.clash = make(map[id]slot)
	}
	s.clash[k] = sl
}

// deleteDone deletes k's completed record, of hash h, at sl, and compacts
// its chunk if it should be. Callers hold s.mu.
func (s *Store) deleteDone(k id, h uint64, sl slot) {
	if cur, ok := s.done[h]; ok && cur == sl {
		delete(s.done, h)
	} else {
		delete(s.clash, k)
	}
	if s.arena.drop(sl) {
		s.compact(int(sl.chunk))
	}
}

// compact moves the live records of chunk i, unless it is the one
// appended to, to the one appended to, and frees chunk i. Callers hold
// s.mu and call it outside any range over s.done and s.clash.
func (s *Store) compact(i int) {
	a := &s.arena
	if i == a.cur || a.chunks[i] == nil || a.live[i]*4 >= len(a.chunks[i]) {
		return // the chunk appended to, a freed one, or one made since
	}
	c := a.chunks[i]
	for off := 0; a.live[i] > 0 && off < len(c); {
		old := slot{uint32(i), uint32(off)}
		b := a.get(old)
		off += len(b)
		r := rd{b: b, i: fixedLen}
		k := id{string(r.fieldBytes()), string(r.fieldBytes())}
		h := s.hash(k)
		if cur, ok := s.done[h]; ok && cur == old {
			s.done[h] = a.put(b)
		} else if cur, ok := s.clash[k]; ok && cur == old {
			s.clash[k] = a.put(b)
		} else {
			continue // a deleted record
		}
		a.live[i] -= len(b)
	}
	a.chunks[i], a.live[i] = nil, 0
	a.free = append(a.free, i)
}

// maxHeaders bounds Store.headers.
const maxHeaders = 64

// encode appends the encoding of rec, completed with resp, to buf. It
// returns the encoding and where the response's header's bytes are in it.
func (s *Store) encode(buf []byte, rec *idemdriver.Record, resp *idemdriver.Response) (b []byte, hdrFrom, hdrTo int) {
	le := binary.LittleEndian
	b = append(buf, make([]byte, fixedLen)...)
	le.PutUint64(b[offAttempts:], uint64(rec.Attempts))
	le.PutUint64(b[offRedrives:], uint64(rec.Redrives))
	le.PutUint64(b[offStatus:], uint64(resp.Status))
	s.putTime(b[offLeaseUntil:], rec.LeaseUntil)
	s.putTime(b[offCreatedAt:], rec.CreatedAt)
	s.putTime(b[offCompletedAt:], rec.CompletedAt)
	s.putTime(b[offExpiresAt:], rec.ExpiresAt)
	b = appendString(b, rec.User)
	b = appendString(b, rec.Key)
	b = appendString(b, rec.Fingerprint)
	b, hdrFrom, hdrTo = appendHeader(b, resp.Header)
	b = appendBytes(b, resp.Body)
	b, _, _ = appendHeader(b, resp.Trailer)
	b = appendString(b, rec.Method)
	b = appendString(b, rec.Path)
	b = appendString(b, rec.Owner)
	b, _, _ = appendHeader(b, rec.Header)
	b = appendBytes(b, rec.Body)
	le.PutUint32(b, uint32(len(b)))
	return b, hdrFrom, hdrTo
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s))+1)
	return append(b, s...)
}

func appendBytes(b, p []byte) []byte {
	if p == nil {
		return append(b, 0)
	}
	b = binary.AppendUvarint(b, uint64(len(p))+1)
	return append(b, p...)
}

// appendHeader appends the field of h to b and returns where h's bytes
// (after the field's length) are in it. The names are in order, so that
// equal headers have equal bytes.
func appendHeader(b []byte, h http.Header) (_ []byte, from, to int) {
	if h == nil {
		b = append(b, 0)
		return b, len(b), len(b)
	}
	var room [8]string
	names := room[:0]
	n := uvarintLen(len(h))
	for k, v := range h {
		names = append(names, k)
		n += uvarintLen(len(k)) + len(k) + uvarintLen(len(v)+1)
		for _, s := range v {
			n += uvarintLen(len(s)) + len(s)
		}
	}
	slices.Sort(names)
	b = binary.AppendUvarint(b, uint64(n)+1)
	from = len(b)
	b = binary.AppendUvarint(b, uint64(len(h)))
	for _, k := range names {
		v := h[k]
		b = binary.AppendUvarint(b, uint64(len(k)))
		b = append(b, k...)
		if v == nil {
			b = append(b, 0)
			continue
		}
		b = binary.AppendUvarint(b, uint64(len(v))+1)
		for _, s := range v {
			b = binary.AppendUvarint(b, uint64(len(s)))
			b = append(b, s...)
		}
	}
	return b, from, len(b)
}

func uvarintLen(n int) int {
	return (bits.Len64(uint64(n)|1) + 6) / 7
}

// putTime writes t at b: Unix seconds, nanoseconds and its location's
// index in s.locs (t's own, or one of the same name that gives t the same
// zone).
func (s *Store) putTime(b []byte, t time.Time) {
	loc := t.Location()
	i := slices.Index(s.locs, loc)
	if i < 0 {
		// Another *Location of a zone kept (a clock making one per call,
		// as time.FixedZone or time.LoadLocation do): one that gives t the
		// same name and offset, so that s.locs does not grow per record.
		name, off := t.Zone()
		i = slices.IndexFunc(s.locs, func(l *time.Location) bool {
			if l.String() != loc.String() {
				return false
			}
			n, o := t.In(l).Zone()
			return n == name && o == off
		})
	}
	if i < 0 {
		i = len(s.locs)
		s.locs = append(s.locs, loc)
	}
	binary.LittleEndian.PutUint64(b, uint64(t.Unix()))
	binary.LittleEndian.PutUint32(b[8:], uint32(t.Nanosecond()))
	binary.LittleEndian.PutUint32(b[12:], uint32(i))
}

// timeAt reads the time putTime wrote at b[off:].
func (s *Store) timeAt(b []byte, off int) time.Time {
	le := binary.LittleEndian
	return time.Unix(int64(le.Uint64(b[off:])), int64(le.Uint32(b[off+8:]))).In(s.locs[le.Uint32(b[off+12:])])
}

// expiresAt is the expiry of the encoded record b.
func (s *Store) expiresAt(b []byte) time.Time { return s.timeAt(b, offExpiresAt) }

// rd reads the fields of an encoded record b from i on; when s is set,
// it is string(b), which the strings read are cut from.
type rd struct {
	b []byte
	s string
	i int
}

func (r *rd) uvarint() int {
	var x uint64
	for sh := 0; ; sh += 7 {
		c := r.b[r.i]
		r.i++
		x |= uint64(c&0x7f) << sh
		if c < 0x80 {
			return int(x)
		}
	}
}

// span reads a field's length and returns where its bytes are; ok is
// false for a nil one.
func (r *rd) span() (from, to int, ok bool) {
	n := r.uvarint()
	if n == 0 {
		return r.i, r.i, false
	}
	from = r.i
	r.i += n - 1
	return from, r.i, true
}

// fieldBytes reads a field: b's own bytes.
func (r *rd) fieldBytes() []byte {
	from, to, ok := r.span()
	if !ok {
		return nil
	}
	return r.b[from:to:to]
}

// field reads a string field, cut from r.s.
func (r *rd) field() string {
	from, to, _ := r.span()
	return r.s[from:to]
}

// fieldIs reads a string field and reports whether it is s, without a
// copy.
func (r *rd) fieldIs(s string) bool {
	from, to, _ := r.span()
	return string(r.b[from:to]) == s
}

// clonedBytes reads a field as a copy.
func (r *rd) clonedBytes() []byte { return bytes.Clone(r.fieldBytes()) }

// str reads a string of a header (a uvarint length and the bytes), cut
// from r.s.
func (r *rd) str() string {
	n := r.uvarint()
	r.i += n
	return r.s[r.i-n : r.i]
}

// parseHeader reads the header whose bytes appendHeader wrote as b, with
// s == string(b): its strings are cut from s and its values' slices
// taken from room while it lasts.
func parseHeader(b []byte, s string, room []string) http.Header {
	r := rd{b: b, s: s}
	n := r.uvarint()
	h := make(http.Header, n)
	for range n {
		k := r.str()
		nv := r.uvarint()
		if nv == 0 {
			h[k] = nil
			continue
		}
		nv--
		var v []string
		if nv <= len(room) && room != nil { // never a nil slice for an empty one
			v, room = room[:nv:nv], room[nv:]
		} else {
			v = make([]string, nv)
		}
		for j := range v {
			v[j] = r.str()
		}
		h[k] = v
	}
	return h
}

// header reads a header field of r as a header of its own: a copy of
// s.headers' one for the same bytes if there is one, else one whose
// strings share one new string.
func (s *Store) header(r *rd, room []string) http.Header {
	from, to, ok := r.span()
	if !ok {
		return nil
	}
	b := r.b[from:to]
	if h, ok := s.headers[string(b)]; ok {
		return cloneHeader(h, room)
	}
	if r.s != "" {
		return parseHeader(b, r.s[from:to], room)
	}
	return parseHeader(b, string(b), room)
}

// shareHeader is told the bytes b of a response header just stored: it
// adds them to s.headers, so that replays share their strings, when
// there is room or when they are the last header's bytes too (a header
// that returns).
func (s *Store) shareHeader(b []byte) {
	if len(b) == 0 {
		return
	}
	if _, ok := s.headers[string(b)]; ok {
		return
	}
	again := bytes.Equal(b, s.lastHeader)
	s.lastHeader = append(s.lastHeader[:0], b...)
	if len(s.headers) >= maxHeaders {
		if !again {
			return
		}
		for k := range s.headers {
			delete(s.headers, k)
			break
		}
	}
	k := string(b)
	s.headers[k] = parseHeader(b, k, nil)
}

// response decodes the response of the encoded record b: the replay.
func (s *Store) response(b []byte) *idemdriver.Response {
	r := rd{b: b, i: fixedLen}
	r.span() // User
	r.span() // Key
	r.span() // Fingerprint
	c := new(responseCopy)
	c.resp.Status = int(int64(binary.LittleEndian.Uint64(b[offStatus:])))
	c.resp.Header = s.header(&r, c.vals[:])
	c.resp.Body = r.clonedBytes()
	c.resp.Trailer = s.header(&r, nil)
	return &c.resp
}

// fingerprintIs reports whether the encoded record b's Fingerprint is fp.
func fingerprintIs(b []byte, fp string) bool {
	r := rd{b: b, i: fixedLen}
	r.span() // User
	r.span() // Key
	return r.fieldIs(fp)
}

// record decodes the encoded record b: a Record of its own, whose
// strings share one new string.
func (s *Store) record(b []byte) *idemdriver.Record {
	le := binary.LittleEndian
	r := rd{b: b, s: string(b), i: fixedLen}
	c := new(recordCopy)
	rec := &c.rec
	rec.Attempts = int(int64(le.Uint64(b[offAttempts:])))
	rec.Redrives = int(int64(le.Uint64(b[offRedrives:])))
	rec.LeaseUntil = s.timeAt(b, offLeaseUntil)
	rec.CreatedAt = s.timeAt(b, offCreatedAt)
	rec.CompletedAt = s.timeAt(b, offCompletedAt)
	rec.ExpiresAt = s.timeAt(b, offExpiresAt)
	rec.User, rec.Key, rec.Fingerprint = r.field(), r.field(), r.field()
	c.resp.Status = int(int64(le.Uint64(b[offStatus:])))
	c.resp.Header = s.header(&r, c.vals[:])
	c.resp.Body = r.clonedBytes()
	c.resp.Trailer = s.header(&r, nil)
	rec.Response = &c.resp
	rec.Method, rec.Path, rec.Owner = r.field(), r.field(), r.field()
	rec.Header = s.header(&r, nil)
	rec.Body = r.clonedBytes()
	return rec
}

// recordCopy is a decoded record with its response and room for a few
// header values.
type recordCopy struct {
	rec  idemdriver.Record
	resp idemdriver.Response
	vals [4]string
}
