package redisfront

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The scripts name every key they touch in KEYS, all with one hash tag, so
// that a Redis Cluster runs each on the shard that holds the key.

// claimScript: KEYS lock, resp; ARGV claim token, its PX. It returns one
// string: "r" and the entry for a cached response, "l" and the lock for a
// held lock, or "" after taking the lock with the claim token. (One bulk
// string, rather than an array with a number, is one value for the client
// to read and allocate.)
var claimScript = redis.NewScript(`
local r = redis.call('GET', KEYS[2])
if r then return 'r' .. r end
local l = redis.call('GET', KEYS[1])
if l then return 'l' .. l end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ''
`)

// setLockScript: KEYS lock, the holder's end marker, resp; ARGV lease
// lock, PX. It writes the lease lock unless the holder's attempt ended,
// and drops the cached response, which a leased key cannot have.
var setLockScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[3])
return 1
`)

// fillScript: KEYS resp, lock; ARGV entry (or ""), PX, claim token (or "").
// It caches the entry and compare-and-deletes the claim token.
var fillScript = redis.NewScript(`
if ARGV[1] ~= '' then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end
if ARGV[3] ~= '' and redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1
`)

// unlockScript: KEYS lock; ARGV claim token. Compare-and-delete.
var unlockScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
`)

// endScript: KEYS lock, the attempt's end marker, resp; ARGV the
// attempt's lease lock prefix, the marker's PX, entry (or ""), its PX. It
// marks the attempt ended, caches the entry, and deletes the lock if it
// is the attempt's.
var endScript = redis.NewScript(`
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
if ARGV[3] ~= '' then redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4]) end
local l = redis.call('GET', KEYS[1])
if l and string.sub(l, 1, string.len(ARGV[1])) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
`)

// What claimScript found.
const (
	claimTaken  = 0
	claimCached = 1
	claimLocked = 2
)

var errBadReply = errors.New("redisfront: unexpected reply from redis")

func claimResult(res any) (kind int, val string, err error) {
	v, ok := res.(string)
	if !ok {
		return 0, "", fmt.Errorf("%w: %v", errBadReply, res)
	}
	if v == "" {
		return claimTaken, "", nil
	}
	switch v[0] {
	case 'r':
		return claimCached, v[1:], nil
	case 'l':
		return claimLocked, v[1:], nil
	}
	return 0, "", fmt.Errorf("%w: %.40q", errBadReply, v)
}

// Lock values. A claim in progress is "c|" + random token. A lease is
// "l|" + tag of the owner + "|" + lease end in unix nanoseconds + "|" +
// fingerprint; the owner's tag (fixed length, hex) lets the end script
// recognise it by prefix whatever the owner token holds.

func claimValue(token string) string { return "c|" + token }

// ownerTag is the tag of owner in lock values and end markers.
func ownerTag(owner string) string {
	h := sha256.Sum256([]byte(owner))
	return hex.EncodeToString(h[:16])
}

func leasePrefix(owner string) string { return leaseTagPrefix(ownerTag(owner)) }

// leaseTagPrefix is leasePrefix of the owner whose tag is tag.
func leaseTagPrefix(tag string) string { return "l|" + tag + "|" }

func leaseValue(owner string, until time.Time, fingerprint string) string {
	return leaseTagValue(ownerTag(owner), until, fingerprint)
}

// leaseTagValue is leaseValue of the owner whose tag is tag.
func leaseTagValue(tag string, until time.Time, fingerprint string) string {
	var n [20]byte
	var b strings.Builder
	b.Grow(2 + len(tag) + 1 + len(n) + 1 + len(fingerprint))
	b.WriteString("l|")
	b.WriteString(tag)
	b.WriteByte('|')
	b.Write(strconv.AppendInt(n[:0], until.UnixNano(), 10))
	b.WriteByte('|')
	b.WriteString(fingerprint)
	return b.String()
}

type lockValue struct {
	leased      bool   // a lease; otherwise a claim in progress
	owner       string // the holder's tag (ownerTag)
	until       time.Time
	fingerprint string
}

func parseLock(v string) (lockValue, bool) {
	if strings.HasPrefix(v, "c|") {
		return lockValue{}, true
	}
	rest, ok := strings.CutPrefix(v, "l|")
	if !ok {
		return lockValue{}, false
	}
	owner, rest, ok := strings.Cut(rest, "|")
	if !ok {
		return lockValue{}, false
	}
	us, fingerprint, ok := strings.Cut(rest, "|")
	if !ok {
		return lockValue{}, false
	}
	until, err := strconv.ParseInt(us, 10, 64)
	if err != nil {
		return lockValue{}, false
	}
	return lockValue{leased: true, owner: owner, until: time.Unix(0, until), fingerprint: fingerprint}, true
}

// purgeScript: KEYS lock, the purged attempt's end marker, resp; ARGV the
// attempt's lease lock prefix, the marker's PX. It marks the attempt
// ended, so that a lease lock for it written late is refused, deletes its
// lease lock (never another attempt's, nor a claim in progress), and drops
// the cached response (a key purged has none; dropping one is always
// safe, Redis being a cache).
var purgeScript = redis.NewScript(`
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
local l = redis.call('GET', KEYS[1])
if l and string.sub(l, 1, string.len(ARGV[1])) == ARGV[1] then redis.call('DEL', KEYS[1]) end
redis.call('DEL', KEYS[3])
return 1
`)
