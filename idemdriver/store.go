package idemdriver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"
	"unicode/utf8"
)

// Store keeps idempotency records. Implementations must make Claim atomic on
// (user, key): of any number of concurrent claims for a free key exactly one
// gets a Lease. Every method that changes a claimed record is fenced on the
// lease's owner token and returns ErrFenced when another attempt took it over.
type Store interface {
	// Claim claims (p.User, p.Key). It returns a Lease when the caller now
	// owns the key (a new key, a completed one whose expiry passed, one
	// whose lease ran out and whose fingerprint matches, or one that
	// p.Owner already holds), a Response when the key completed with the
	// same fingerprint, *InFlightError while another lease is live, and
	// ErrFingerprintMismatch when the fingerprint differs.
	//
	// Expiry never takes a key from an attempt that may have paid: a record
	// without a response is not replaced, whatever its expiry says; it is
	// taken over (same CreatedAt) once its lease ran out, like any other.
	//
	// A Claim is safe to send again with the same p.Owner after an error
	// (an answer lost with the connection): if the first call took the key,
	// the second finds p.Owner holding it and returns that lease.
	//
	// The store copies what it keeps of p and changes none of it (see
	// ClaimParams.Method). The Response it returns is the caller's own:
	// nothing the store keeps shares memory with it (the middleware hands
	// its header values to the answer as they are).
	Claim(ctx context.Context, p ClaimParams) (Claim, error)

	// Begin opens the transaction in which the handler writes and in which
	// the outcome is committed. It does not check the lease; Tx.Complete does.
	Begin(ctx context.Context, l *Lease) (Tx, error)

	// Release deletes the record, so the key is free again. Fenced.
	Release(ctx context.Context, l *Lease) error

	// Fail ends the lease now, keeping the record and its fingerprint, so
	// the same request may run again at once. (Attempts are counted when a
	// key is claimed or taken over.) Fenced.
	Fail(ctx context.Context, l *Lease) error

	// Get returns the record for (user, key), or ErrNotFound. A completed
	// record whose expiry passed is reported as ErrNotFound; a record
	// without a response is returned whatever its expiry.
	Get(ctx context.Context, user, key string) (*Record, error)
}

// Tx is the unit of work shared by the handler and the stored response.
// Store packages give handlers access to the underlying database
// transaction (sqlitestore.FromContext, pgstore.FromContext, memstore.FromContext).
// Its Complete and Rollback are the middleware's: the handles that
// handlers get (TxFromContext's Tx and the stores' accessors) refuse to
// commit or roll back, with an error matching ErrTxOwned.
type Tx interface {
	// Complete commits the handler's writes together with the outcome,
	// fenced on the lease's owner. With resp non-nil the response is stored
	// for replay; with resp nil the record is deleted in the same
	// transaction (the work stands but the key is free; the middleware
	// never does this). If the lease was lost it rolls back and returns
	// ErrFenced. A record whose expiry passed while its attempt ran is kept
	// for its TTL again from the completion, so that the client's retry
	// still finds the answer instead of starting a new operation.
	// The store copies what it keeps of resp, whose header values and
	// body are the handler's recorded answer, not copies.
	Complete(ctx context.Context, resp *Response) error
	// Rollback discards the transaction. It is a no-op after Complete.
	Rollback(ctx context.Context) error
}

// UnwrapTx returns the innermost transaction of tx, following the
// Unwrap() Tx method that store wrappers (such as redisfront's) give their
// transactions, and that TxFromContext's Tx has. Stores' FromContext
// accessors call it. What it returns is the store's own transaction,
// whose Complete and Rollback the middleware calls: a handler reaches
// its writes through the store's accessor instead, which refuses to end
// the transaction.
func UnwrapTx(tx Tx) Tx {
	for {
		u, ok := tx.(interface{ Unwrap() Tx })
		if !ok {
			return tx
		}
		tx = u.Unwrap()
	}
}

// Sweeper is implemented by stores that can list abandoned requests and
// delete expired keys; the completer and the cleaner use it.
type Sweeper interface {
	// Abandoned returns up to p.Limit (<= 0: none) records that have no
	// response, whose lease ran out, expired or not (an attempt that may
	// have paid is finished whatever the TTL), and that are due for a
	// re-drive by p: fewer than p.MaxRedrives re-drives, and their backoff
	// passed, by the store's clock. The longest waiting come first (the
	// earliest lease end, then the oldest record, then user and key).
	// Keys a completer gave up on, or that wait for their backoff, are
	// left out, so they never crowd out the keys that are due.
	Abandoned(ctx context.Context, p AbandonedParams) ([]Record, error)
	// DeleteExpired deletes up to limit completed records whose expiry
	// passed, and reports how many it deleted. A record without a response
	// is never deleted by expiry.
	DeleteExpired(ctx context.Context, limit int) (int, error)
}

// AbandonedParams selects the abandoned records that are due.
type AbandonedParams struct {
	// Limit bounds how many records are returned; <= 0: none.
	Limit int
	// MaxRedrives leaves out records re-driven this many times (the
	// completer gave them up). <= 0: none are left out.
	MaxRedrives int
	// Backoff and MaxBackoff: a record re-driven n >= 1 times is due once
	// min(Backoff·2^(n−1), MaxBackoff) has passed since its lease ended,
	// by the store's clock; one never re-driven is due as soon as its lease
	// ended. Zero Backoff: no backoff. MaxBackoff <= 0: no cap.
	Backoff, MaxBackoff time.Duration
	// Kinds, when not nil, selects only the records of the kinds it
	// names (Selects), before Limit applies: a completer lists only what
	// it can re-drive, so that records it would skip cannot fill its
	// batches. nil: every kind.
	Kinds *AbandonedKinds
}

// AbandonedKinds names the kinds of record AbandonedParams.Kinds selects.
type AbandonedKinds struct {
	// HTTP selects the middleware's records (a non-empty Method).
	HTTP bool
	// Operations selects the Do operations (an empty Method) whose
	// Operation (the record's Path) is one of these.
	Operations []string
}

// StoredOperations returns the names of k.Operations that a record can
// have (valid UTF-8 without NUL, as DoParams.Operation must be): a SQL
// store matches these, since the others select no record and its
// database may refuse or rewrite them.
func (k *AbandonedKinds) StoredOperations() []string {
	var out []string
	for _, op := range k.Operations {
		if utf8.ValidString(op) && !strings.ContainsRune(op, 0) {
			out = append(out, op)
		}
	}
	return out
}

// Selects reports whether p.Kinds selects rec (always, when it is nil).
// Stores that decide in Go use it with Due, and SQL stores compute the
// same.
func (p AbandonedParams) Selects(rec *Record) bool {
	switch k := p.Kinds; {
	case k == nil:
		return true
	case rec.Method != "":
		return k.HTTP
	default:
		return slices.Contains(k.Operations, rec.Path)
	}
}

// Due reports whether rec is due for a re-drive at now by p (without its
// Limit): stores that decide in Go use it, and SQL stores compute the
// same.
func (p AbandonedParams) Due(rec *Record, now time.Time) bool {
	if rec.Response != nil || now.Before(rec.LeaseUntil) {
		return false
	}
	if p.MaxRedrives > 0 && rec.Redrives >= p.MaxRedrives {
		return false
	}
	return !now.Before(rec.LeaseUntil.Add(p.BackoffAfter(rec.Redrives)))
}

// BackoffAfter is the pause after a lease's end before the next re-drive
// of a record re-driven redrives times.
func (p AbandonedParams) BackoffAfter(redrives int) time.Duration {
	if redrives <= 0 || p.Backoff <= 0 {
		return 0
	}
	d := p.Backoff
	for i := 1; i < redrives && (p.MaxBackoff <= 0 || d < p.MaxBackoff); i++ {
		if d > math.MaxInt64/2 {
			d = math.MaxInt64 // never, in effect, unless capped below
			break
		}
		d *= 2
	}
	if p.MaxBackoff > 0 {
		d = min(d, p.MaxBackoff)
	}
	return d
}

// RedriveParams describe the operation a completer re-drives; see
// ClaimParams.Redrive.
type RedriveParams struct {
	// CreatedAt is the listed record's CreatedAt: the operation.
	CreatedAt time.Time
	// Due is the completer's budget and backoff; its Limit is unused.
	Due AbandonedParams
}

// ClaimParams describes the request that claims a key.
type ClaimParams struct {
	User        string
	Key         string
	Fingerprint string
	// Redrive, when set, marks the claim of a completer re-driving the
	// abandoned operation it listed. Such a claim never inserts or
	// replaces a record: it takes over only that operation (same
	// CreatedAt), only while it is due by Redrive.Due at the store's clock,
	// and answers ErrNotDue otherwise; its takeover counts in the record's
	// Redrives, apart from the clients' attempts. So completers working
	// from lists made at the same moment never skip a backoff, spend the
	// budget of another operation, or start a new one.
	Redrive *RedriveParams
	// Owner is the fencing token of this attempt; NewOwner makes one.
	// Sending the same Claim again with the same Owner is safe: a claim
	// whose answer was lost is found and returned, not answered 409.
	// Empty: the store makes a token, and a repeated call cannot
	// recognise the first.
	Owner string
	// Method, Path, Header and Body are kept so an abandoned request can be
	// completed later without its client. A store reads them and copies
	// what it keeps; it never changes them: the middleware hands the same
	// Header to many claims, and Body is the request's. An operation run
	// through Do has an empty Method, its name as Path, no Header and its
	// input as Body; stores keep them as they keep any other.
	Method string
	Path   string
	Header http.Header
	Body   []byte
	// Lease is how long the claim is exclusive. Zero means DefaultLease.
	Lease time.Duration
	// TTL is how long the key lives after its first use. Zero means DefaultTTL.
	TTL time.Duration
}

// Claim is the result of Store.Claim: exactly one of Lease and Response is set.
type Claim struct {
	// Lease is set when the caller owns the key and must run the request.
	Lease *Lease
	// Response is set when the key completed; it is to be replayed.
	Response *Response
	// ExpiresIn is how long the record had left to live, by the store's
	// clock, when Claim decided; zero when it is unknown or already past.
	// A cache in front of the store (redisfront) keeps an entry no longer
	// than this, measured on its own monotonic clock, so that it never
	// outlives the record whatever the instances' wall clocks say.
	ExpiresIn time.Duration
}

// Lease is a caller's exclusive hold on a key.
type Lease struct {
	User  string
	Key   string
	Owner string // random per attempt: the fencing token
	Until time.Time
	// Attempt counts the attempts made with this key, this one included.
	Attempt int
	// CreatedAt is when the record was created: with User and Key it names
	// one operation, the same for every attempt at it, and a key used again
	// after it expired gets a new one. It is exactly the stored value, so
	// that values derived from it agree across attempts and instances.
	CreatedAt time.Time
}

// Response is a stored answer.
type Response struct {
	Status int
	Header http.Header
	Body   []byte
	// Trailer holds the trailers sent after the body; nil (or empty)
	// without any. Stores keep it with the rest of the response.
	Trailer http.Header
}

// Record is the stored state of one key.
type Record struct {
	User        string
	Key         string
	Fingerprint string
	Method      string // empty for an operation run through Do
	Path        string // the request target, or a Do operation's name
	Header      http.Header
	Body        []byte
	Owner       string
	LeaseUntil  time.Time
	Attempts    int       // every attempt, the clients' and the completers'
	Redrives    int       // takeovers by a completer (ClaimParams.Redrive)
	Response    *Response // nil until completed
	CreatedAt   time.Time
	CompletedAt time.Time // zero until completed
	ExpiresAt   time.Time
}

// Normalize fills zero fields of p with their defaults. Stores call it.
func (p ClaimParams) Normalize() ClaimParams {
	if p.Lease <= 0 {
		p.Lease = DefaultLease
	}
	if p.TTL <= 0 {
		p.TTL = DefaultTTL
	}
	return p
}

// NewOwner returns a fresh random fencing token (128 bits, hex).
func NewOwner() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Defaults of ClaimParams (see Normalize) and of the completer's budget.
const (
	DefaultTTL   = 24 * time.Hour
	DefaultLease = 30 * time.Second
	// DefaultCompleterMaxAttempts is how many times a completer re-drives
	// one key before it gives up (CompleterOptions.MaxAttempts, Budget).
	DefaultCompleterMaxAttempts = 20
)

// SweepingStore is a Store that is also a Sweeper, as memstore,
// sqlitestore, pgstore and redisfront are: what a Completer needs.
type SweepingStore interface {
	Store
	Sweeper
}
