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

func FuzzParseKey(f *testing.F) {
	for _, s := range []string{"abc", `"abc"`, `"a\"b"`, `"`, ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		k, err := ParseKey(s)
		if err != nil {
			return
		}
		if len(k) == 0 || len(k) > MaxKeyLength {
			t.Fatalf("ParseKey(%q) = %q: bad length", s, k)
		}
		for i := 0; i < len(k); i++ {
			if k[i] < 0x21 || k[i] > 0x7e {
				t.Fatalf("ParseKey(%q) = %q: invisible byte", s, k)
			}
		}
	})
}
