package idemdriver

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"hash"
)

// ChildKey derives the key of a downstream call made by the operation l
// holds, from that operation's identity: its user, its key and its
// record's creation time. Every attempt at the operation (a retry, a
// takeover, the completer's re-drive) derives the same key, so the
// downstream service runs the call once; two users who both chose the key
// "order-1", or one key used again after it expired, name two operations
// and get two keys; two steps get two keys. The result is 64 hex
// characters (SHA-256 over length-prefixed fields).
func (l *Lease) ChildKey(step string) string {
	h := sha256.New()
	lengthPrefixed(h, "idem-go/child-key/v1")
	lengthPrefixed(h, l.User)
	lengthPrefixed(h, l.Key)
	var micros int64 // stores keep microseconds; the zero time is 0
	if !l.CreatedAt.IsZero() {
		micros = l.CreatedAt.UnixMicro()
	}
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(micros))
	h.Write(b[:])
	lengthPrefixed(h, step)
	return hex.EncodeToString(h.Sum(nil))
}

// lengthPrefixed writes s after its length, so that no two distinct lists
// of fields encode alike.
func lengthPrefixed(h hash.Hash, s string) {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(len(s)))
	h.Write(b[:])
	h.Write([]byte(s))
}
