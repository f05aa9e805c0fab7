package idem

// A fuzz test of the query's part in the fingerprint, by what a handler
// reads from it rather than against the reference (that is
// FuzzFingerprintSameAsReference). `go test` runs the seeds; `go test -run='^$'
// -fuzz=FuzzFingerprintQuery .` searches further.

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
)

// fuzzQuerySeg is one non-empty segment of a raw query, read as
// Fingerprint reads it.
type fuzzQuerySeg struct {
	raw         string // as it came
	decoded     bool   // false: a bad escape or a ";", kept as it came
	pair        bool   // it holds a "="
	name, value string // decoded
}

// key is what the segment is sorted by: its decoded name, or the
// segment itself when it does not decode.
func (s fuzzQuerySeg) key() string {
	if s.decoded {
		return s.name
	}
	return s.raw
}

func fuzzQuerySegs(q string) []fuzzQuerySeg {
	var segs []fuzzQuerySeg
	for _, raw := range strings.Split(q, "&") {
		if raw == "" {
			continue
		}
		s := fuzzQuerySeg{raw: raw}
		if !strings.Contains(raw, ";") {
			n, v, pair := strings.Cut(raw, "=")
			dn, err1 := url.QueryUnescape(n)
			dv, err2 := url.QueryUnescape(v)
			if err1 == nil && err2 == nil {
				s.decoded, s.pair, s.name, s.value = true, pair, dn, dv
			}
		}
		segs = append(segs, s)
	}
	return segs
}

// fuzzQueryEscape spells s so that url.QueryUnescape gives it back:
// unreserved bytes as they are or percent-encoded, a space as "+" or
// %20, any other byte percent-encoded, hex digits in either case.
func fuzzQueryEscape(s string, r *fuzzRand) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == ' ' && r.intn(2) == 0:
			b.WriteByte('+')
		case fuzzUnreserved(c) && r.intn(2) == 0:
			b.WriteByte(c)
		case r.intn(2) == 0:
			fmt.Fprintf(&b, "%%%02x", c)
		default:
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// spell writes the segment another way a handler reads alike; one that
// does not decode stays as it came.
func (s fuzzQuerySeg) spell(r *fuzzRand) string {
	if !s.decoded {
		return s.raw
	}
	if !s.pair {
		return fuzzQueryEscape(s.name, r)
	}
	return fuzzQueryEscape(s.name, r) + "=" + fuzzQueryEscape(s.value, r)
}

// fuzzQueryJoin spells segs in another order that keeps the order of the
// segments of one name, with empty segments here and there.
func fuzzQueryJoin(segs []fuzzQuerySeg, r *fuzzRand) string {
	var groups [][]fuzzQuerySeg
	at := map[string]int{}
	for _, s := range segs {
		i, ok := at[s.key()]
		if !ok {
			i = len(groups)
			at[s.key()] = i
			groups = append(groups, nil)
		}
		groups[i] = append(groups[i], s)
	}
	var out []string
	for len(groups) > 0 {
		for r.intn(4) == 0 {
			out = append(out, "")
		}
		i := r.intn(len(groups))
		out = append(out, groups[i][0].spell(r))
		if groups[i] = groups[i][1:]; len(groups[i]) == 0 {
			groups = append(groups[:i], groups[i+1:]...)
		}
	}
	if r.intn(4) == 0 {
		out = append(out, "")
	}
	return strings.Join(out, "&")
}

// FuzzFingerprintQuery: Fingerprint never panics on a query; the query
// spelt another way that a handler reads alike (parameters of different
// names reordered, escapes changed, a space as "+" or %20, empty
// segments added or dropped) has the same fingerprint, and so has the
// form url.Values.Encode gives a query that url.ParseQuery reads whole
// (every segment with its "="); a change a handler sees (a value
// changed, a name with "=" or without, two different values of one name
// swapped, a parameter dropped) gives another.
func FuzzFingerprintQuery(f *testing.F) {
	for i, q := range fpQueries {
		f.Add(q, uint64(i))
	}
	f.Add("dry_run=true", uint64(0))
	f.Add("a=1&b=x+y&a=2&c", uint64(7))
	f.Fuzz(func(t *testing.T, q string, seed uint64) {
		fp := func(q string) string {
			t.Helper()
			s, err := Fingerprint(fpRequest(http.MethodPost, "/x", q), []byte(`{}`))
			if err != nil {
				t.Fatalf("Fingerprint(?%q): %v", q, err)
			}
			return s
		}
		base := fp(q)
		if len(q) > 4096 {
			return // the checks below grow faster than the query
		}
		segs := fuzzQuerySegs(q)
		if len(segs) == 0 {
			if none := fp(""); base != none {
				t.Fatalf("?%q names no parameter, yet its fingerprint is not that of no query", q)
			}
			return
		}
		r := &fuzzRand{s: seed}
		if alt := fuzzQueryJoin(segs, r); fp(alt) != base {
			t.Fatalf("?%q and ?%q read alike, fingerprints differ", q, alt)
		}
		whole := true
		for _, s := range segs {
			whole = whole && s.decoded && s.pair
		}
		if v, err := url.ParseQuery(q); whole && err == nil {
			if enc := v.Encode(); fp(enc) != base {
				t.Fatalf("?%q and ?%q (url.Values.Encode of it) read alike, fingerprints differ", q, enc)
			}
		}

		// A change a handler sees, in another spelling.
		changed := append([]fuzzQuerySeg(nil), segs...)
		i := r.intn(len(changed))
		switch s := &changed[i]; {
		case r.intn(3) == 0:
			changed = append(changed[:i], changed[i+1:]...)
		case s.decoded && s.pair:
			s.value += "x"
		case s.decoded:
			s.pair = true
		default:
			changed = append(changed[:i], changed[i+1:]...)
		}
		if alt := fuzzQueryJoin(changed, r); fp(alt) == base {
			t.Fatalf("?%q and ?%q read differently, fingerprints equal", q, alt)
		}
		for j := range segs {
			for k := j + 1; k < len(segs); k++ {
				a, b := segs[j], segs[k]
				if a.key() != b.key() || a == b || (a.decoded && b.decoded && a.pair == b.pair && a.value == b.value) {
					continue
				}
				swapped := append([]fuzzQuerySeg(nil), segs...)
				swapped[j], swapped[k] = b, a
				if alt := fuzzQueryJoin(swapped, r); fp(alt) == base {
					t.Fatalf("?%q and ?%q give one name its values in another order, fingerprints equal", q, alt)
				}
				return
			}
		}
	})
}
