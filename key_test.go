package idem

import (
	"errors"
	"strings"
	"testing"
)

func TestParseKey(t *testing.T) {
	long := strings.Repeat("a", 255)
	tests := []struct {
		in, want string
		ok       bool
	}{
		{"abc-123", "abc-123", true},
		{`"abc-123"`, "abc-123", true},
		{`"a\"b"`, `a"b`, true},
		{`"a\\b"`, `a\b`, true},
		{"!~", "!~", true},
		{long, long, true},
		{`"` + long + `"`, long, true},
		{"", "", false},
		{`""`, "", false},
		{long + "a", "", false},
		{"a b", "", false},
		{`"a b"`, "", false}, // a valid sf-string, but a space is not visible ASCII
		{"ab\x7f", "", false},
		{"é", "", false},
		{`"abc`, "", false},
		{`"abc"x`, "", false},
		{`"abc";a=1`, "", false},
		{`"a\nb"`, "", false},
		{"\"a\tb\"", "", false},
	}
	for _, tt := range tests {
		got, err := ParseKey(tt.in)
		if tt.ok {
			if err != nil || got != tt.want {
				t.Errorf("ParseKey(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
			}
			continue
		}
		if !errors.Is(err, ErrKeyInvalid) {
			t.Errorf("ParseKey(%q) = %q, %v; want ErrKeyInvalid", tt.in, got, err)
		}
	}
}

// FuzzParseKey: ParseKey never panics; a key it accepts is 1 to 255
// characters of visible ASCII; its bare and sf-string spellings name the
// same key; re-encoding it as an sf-string round-trips. A bare value (no
// leading quote) is accepted exactly when it is such a key, unchanged.
func FuzzParseKey(f *testing.F) {
	for _, s := range []string{
		"abc", `"abc"`, `"a\"b"`, `"`, "", `""`, `"\"`, `"\\"`, `"a\\b"`, `"a\xb"`,
		`"abc"x`, `"abc";a=1`, "a b", `"a b"`, "\"", "ab\x7f", "é", `"é"`,
		strings.Repeat("k", MaxKeyLength), strings.Repeat("k", MaxKeyLength+1),
		`"` + strings.Repeat(`\"`, MaxKeyLength) + `"`, `"` + strings.Repeat(`\"`, MaxKeyLength+1) + `"`,
		"a\"b", `a\b`, "\"\"\"",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		k, err := ParseKey(s)
		bare := !strings.HasPrefix(s, `"`)
		if bare && fuzzIsKey(s) != (err == nil) {
			t.Fatalf("ParseKey(%q) = %q, %v: a bare value is a key exactly when it is 1 to %d visible ASCII", s, k, err, MaxKeyLength)
		}
		if err != nil {
			if !errors.Is(err, ErrKeyInvalid) {
				t.Fatalf("ParseKey(%q): error %v does not wrap ErrKeyInvalid", s, err)
			}
			if k != "" {
				t.Fatalf("ParseKey(%q) = %q with an error", s, k)
			}
			return
		}
		if !fuzzIsKey(k) {
			t.Fatalf("ParseKey(%q) = %q: not 1 to %d visible ASCII", s, k, MaxKeyLength)
		}
		if bare && k != s {
			t.Fatalf("ParseKey(%q) = %q: a bare key must come back unchanged", s, k)
		}
		// The sf-string spelling of the key names the same key.
		sf := fuzzSFString(k)
		if k2, err := ParseKey(sf); err != nil || k2 != k {
			t.Fatalf("ParseKey(%q) = %q; its sf-string %s parses to %q, %v", s, k, sf, k2, err)
		}
		// So does the bare spelling, when there is one.
		if !strings.HasPrefix(k, `"`) {
			if k2, err := ParseKey(k); err != nil || k2 != k {
				t.Fatalf("ParseKey(%q) = %q; the bare spelling parses to %q, %v", s, k, k2, err)
			}
		}
		// A quoted value the parser accepted is the canonical sf-string of
		// its key up to escapes, which RFC 8941 allows only for " and \.
		if !bare && s != sf {
			t.Fatalf("ParseKey(%q) = %q, but the canonical sf-string is %s", s, k, sf)
		}
	})
}

// fuzzIsKey: 1 to MaxKeyLength bytes, each visible ASCII.
func fuzzIsKey(s string) bool {
	if len(s) == 0 || len(s) > MaxKeyLength {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// fuzzSFString serializes s as an RFC 8941 String (section 4.1.6).
func fuzzSFString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		if s[i] == '"' || s[i] == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	b.WriteByte('"')
	return b.String()
}
