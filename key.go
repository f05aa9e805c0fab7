package idem

import (
	"fmt"
	"strings"
)

// MaxKeyLength is the longest key accepted, in bytes.
const MaxKeyLength = 255

// ParseKey reads an Idempotency-Key header value. A value that begins with a
// double quote is an RFC 8941 sf-string and must be a valid one; anything else
// is taken bare. Either way the key is 1 to 255 characters of visible ASCII
// (0x21 to 0x7E), so "abc" and abc name the same key.
func ParseKey(v string) (string, error) {
	if strings.HasPrefix(v, `"`) {
		s, err := parseSFString(v)
		if err != nil {
			return "", err
		}
		v = s
	}
	if v == "" {
		return "", fmt.Errorf("%w: empty", ErrKeyInvalid)
	}
	if len(v) > MaxKeyLength {
		return "", fmt.Errorf("%w: longer than %d characters", ErrKeyInvalid, MaxKeyLength)
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < 0x21 || c > 0x7e {
			return "", fmt.Errorf("%w: character %q at %d is not visible ASCII", ErrKeyInvalid, c, i)
		}
	}
	return v, nil
}

// parseSFString parses a whole header value as an RFC 8941 String item
// without parameters: DQUOTE *(unescaped / "\" ( DQUOTE / "\" )) DQUOTE,
// where unescaped is %x20-21 / %x23-5B / %x5D-7E.
func parseSFString(v string) (string, error) {
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			i++
			if i >= len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", fmt.Errorf("%w: bad escape in sf-string", ErrKeyInvalid)
			}
			b.WriteByte(v[i])
		case c == '"':
			if i != len(v)-1 {
				return "", fmt.Errorf("%w: characters after the closing quote", ErrKeyInvalid)
			}
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", fmt.Errorf("%w: character %q not allowed in sf-string", ErrKeyInvalid, c)
		default:
			b.WriteByte(c)
		}
	}
	return "", fmt.Errorf("%w: unterminated sf-string", ErrKeyInvalid)
}
