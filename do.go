package idem

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/idem-go/idem/idemdriver"
)

// DoParams names one operation run through Do. User, Key and Operation
// are required; every other field documents its default, which a zero
// value stands for. Do refuses a negative duration.
type DoParams struct {
	// User is the namespace of the key: a consumer's name, a tenant. The
	// same key under two users names two operations. Required; valid
	// UTF-8 without NUL.
	User string
	// Key is the idempotency key, such as a message id: 1 to
	// MaxKeyLength characters of visible ASCII, read as ParseKey reads an
	// Idempotency-Key header (so a quoted RFC 8941 sf-string is unquoted).
	Key string
	// Operation names the function: a completer finds it under this name
	// in CompleterOptions.Funcs. Required; at most MaxKeyLength bytes of
	// valid UTF-8 without control characters.
	Operation string
	// Input is handed to the function. It is fingerprinted with
	// Operation (a repeat of the key with another Input or Operation is
	// ErrFingerprintMismatch) and stored with the key, so that a
	// completer can run the function again without the caller.
	Input []byte
	// Lease is how long one attempt holds the key exclusively; it must be
	// longer than the function may run. Default DefaultLease (30s).
	Lease time.Duration
	// TTL is how long the key lives after its first use. Default
	// DefaultTTL (24h).
	TTL time.Duration
	// InFlightWait is how long a repeat waits for a running attempt to
	// finish (and then returns its output) before it returns ErrInFlight.
	// Default 0: ErrInFlight at once.
	InFlightWait time.Duration
	// Logger receives store failures that do not change the outcome and
	// the function's panics. Default slog.Default().
	Logger *slog.Logger
	// Metrics, if set, counts outcomes as the middleware's Options.Metrics
	// does (Executions, Completed, Replays, Conflicts, Mismatches,
	// Failed, Fenced, StoreErrors, StoreRetries). Nil: not counted.
	Metrics *Metrics
}

// DoFunc is an operation run through Do. It writes through the
// transaction of its attempt, TxFromContext(ctx) (or a store's
// FromContext accessor, such as pgstore.FromContext), never on its own:
// its writes commit with its output, or not at all. Do commits or rolls
// back that transaction; the function's attempts to are refused
// (ErrTxOwned). It returns its
// output, which Do stores and hands to every repeat of the key.
//
// A DoFunc may run more than once for one key (after an error, a panic,
// or a crash, by a retry or a completer) but its writes commit once. Its
// input is the caller's: it must not change it.
type DoFunc func(ctx context.Context, input []byte) (output []byte, err error)

// DoResult is what Do returns for an operation that completed.
type DoResult struct {
	// Output is the function's output: this call's, or the one stored by
	// the call that completed the key (then Replayed is true). A replayed
	// empty output may be nil or empty, as the store keeps it.
	Output []byte
	// Replayed is true when the key had completed before: the function
	// did not run.
	Replayed bool
}

// Do runs fn once for (p.User, p.Key), with the protocol of Middleware,
// without HTTP: for queue consumers, jobs and RPC handlers.
//
// Do claims the key in store with a random owner token; store calls are
// sent again after an error, apart from ctx's cancellation. A key that
// completed with the same Operation and Input is answered from the store:
// fn is not called and the result has Replayed set. A key another attempt
// holds is ErrInFlight (after waiting up to p.InFlightWait, while ctx
// lasts); a key first used with another Operation or Input is
// ErrFingerprintMismatch. Otherwise fn runs with a context whose
// TxFromContext begins, on first use, the attempt's transaction; its
// output is committed in that same transaction, fenced on the owner token
// (the transaction is begun for it if fn wrote nothing). An attempt whose
// lease was taken over meanwhile returns ErrFenced, and fn's writes roll
// back. Once the key is claimed, the outcome is committed even if ctx ends
// while fn runs (fn may return ctx's error to stop); a ctx already done
// is its error, before any claim.
//
// When fn returns an error or panics, its writes roll back and the
// attempt ends at once, the key staying bound to its Operation and
// Input: a retry, or a Completer with fn in CompleterOptions.Funcs, runs
// it again. Do then returns fn's error as it is (errors.Is and errors.As
// see it), or, for a panic, an error wrapping ErrHandlerPanicked. A store
// that fails is an error wrapping ErrStoreUnavailable and the store's
// error. Bad params are an error too (wrapping ErrKeyInvalid for the key).
//
// The key's record has an empty Method (no HTTP request has one), Path =
// Operation and Body = Input, and a fingerprint that no HTTP request's
// default Fingerprint equals: an HTTP request with the same user and key
// is refused with 422 (ErrFingerprintMismatch), and the other way round.
func Do(ctx context.Context, store Store, p DoParams, fn DoFunc) (DoResult, error) {
	if store == nil || fn == nil {
		return DoResult{}, errors.New("idem.Do: nil store or function")
	}
	cp, err := p.claimParams()
	if err != nil {
		return DoResult{}, fmt.Errorf("idem.Do: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return DoResult{}, err // nothing claimed: no attempt spent on a call already given up
	}
	call := new(doCall)
	call.p = protocol{store: store, inFlightWait: p.InFlightWait, now: time.Now, metrics: p.Metrics, logger: p.Logger}
	if call.p.metrics == nil {
		call.p.metrics = &call.metrics
	}
	if call.p.logger == nil {
		call.p.logger = slog.Default()
	}
	res, _, err := call.p.do(ctx, &cp, fn)
	return res, err
}

// doCall is what one Do call needs beside its run: the protocol with its
// options, and the metrics it counts in when the caller gave none.
type doCall struct {
	p       protocol
	metrics Metrics
}

// claimParams checks p and returns the claim of its operation.
func (p *DoParams) claimParams() (idemdriver.ClaimParams, error) {
	if p.User == "" || !keepableText(p.User) {
		return idemdriver.ClaimParams{}, errors.New("invalid DoParams.User: empty, not UTF-8, or with NUL")
	}
	if !validOperation(p.Operation) {
		return idemdriver.ClaimParams{}, fmt.Errorf("invalid DoParams.Operation %q: empty, longer than %d bytes, not UTF-8, or with a control character", p.Operation, MaxKeyLength)
	}
	key, err := ParseKey(p.Key)
	if err != nil {
		return idemdriver.ClaimParams{}, err
	}
	for _, d := range [...]struct {
		name string
		v    time.Duration
	}{{"Lease", p.Lease}, {"TTL", p.TTL}, {"InFlightWait", p.InFlightWait}} {
		if d.v < 0 {
			return idemdriver.ClaimParams{}, fmt.Errorf("invalid DoParams.%s %v: negative (zero means the default)", d.name, d.v)
		}
	}
	if lease, ttl := cmp.Or(p.Lease, DefaultLease), cmp.Or(p.TTL, DefaultTTL); lease >= ttl {
		return idemdriver.ClaimParams{}, fmt.Errorf("invalid DoParams.Lease %v: not shorter than DoParams.TTL %v", lease, ttl)
	}
	return idemdriver.ClaimParams{
		User:        p.User,
		Key:         key,
		Fingerprint: doFingerprint(p.Operation, p.Input),
		Owner:       idemdriver.NewOwner(),
		Path:        p.Operation,
		Body:        p.Input,
		Lease:       p.Lease,
		TTL:         p.TTL,
	}, nil
}

// validOperation reports whether op is an operation's name: 1 to
// MaxKeyLength bytes of UTF-8 without control characters.
func validOperation(op string) bool {
	if op == "" || len(op) > MaxKeyLength || !keepableText(op) {
		return false
	}
	for _, r := range op {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return false
		}
	}
	return true
}

// doFingerprint is the fingerprint of a Do operation: the hex sha256 of a
// prefix that begins with NUL (an HTTP fingerprint's hashed bytes begin
// with the request's method, a token, which never holds one), the
// operation's length and name, and the input.
func doFingerprint(op string, input []byte) string {
	h := sha256.New()
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(op)))
	h.Write([]byte("\x00idem.Do\x00"))
	h.Write(n[:])
	h.Write([]byte(op))
	h.Write(input)
	return hex.EncodeToString(h.Sum(nil))
}

// doRun is the memory one run of a DoFunc needs, allocated at once: its
// state, its context and the response given to the store.
type doRun struct {
	st   requestState
	sctx stateCtx
	resp idemdriver.Response
}

// do is Do's state machine on m, with the claim cp (its Path the
// operation, its Body the input): Do's, or a completer's re-drive of a
// Do operation (cp.Redrive set). fnFailed reports that err is fn's own
// (or its panic's): fn ran and failed, as opposed to the key being
// refused or the store failing.
func (m *protocol) do(ctx context.Context, cp *idemdriver.ClaimParams, fn DoFunc) (res DoResult, fnFailed bool, err error) {
	dctx := context.WithoutCancel(ctx)
	c, err := m.claimFrom(ctx, dctx, *cp, nil)
	if err != nil {
		return DoResult{}, false, m.claimFailed(ctx, cp, err)
	}
	if c.Response != nil {
		m.metrics.Replays.Add(1)
		return DoResult{Output: c.Response.Body, Replayed: true}, false, nil
	}
	l := c.Lease
	if cp.Redrive != nil && !l.CreatedAt.Equal(cp.Redrive.CreatedAt) {
		// Not the operation the completer listed (a store that breaks
		// ClaimParams.Redrive's rule): as the middleware's guard, leave it.
		m.fail(dctx, l)
		return DoResult{}, false, ErrNotDue
	}
	r := new(doRun)
	st := &r.st
	m.start(st, l, dctx)
	settled := false
	defer func() {
		if !settled {
			// fn called runtime.Goexit: end the attempt all the same.
			m.abort(st)
		}
		st.rollback() // a no-op after Complete; settles the operation
	}()
	r.sctx = stateCtx{Context: ctx, st: st}
	out, panicked, err := runDoFunc(&r.sctx, fn, cp.Body, m.logger, l, cp.Path)
	settled = true
	if panicked || err != nil {
		m.abort(st)
		return DoResult{}, true, err
	}
	tx, err := m.outcomeTx(st)
	if err != nil {
		return DoResult{}, false, err
	}
	r.resp = idemdriver.Response{Status: http.StatusOK, Body: out}
	if err := m.complete(st, tx, &r.resp); err != nil {
		return DoResult{}, false, err
	}
	return DoResult{Output: out}, false, nil
}

// runDoFunc calls fn and reports whether it panicked; a panic is logged
// and returned as an error wrapping ErrHandlerPanicked.
func runDoFunc(ctx context.Context, fn DoFunc, input []byte, logger *slog.Logger, l *idemdriver.Lease, op string) (out []byte, panicked bool, err error) {
	defer func() {
		if v := recover(); v != nil {
			logger.ErrorContext(ctx, "idem: operation panicked", "user", l.User, "operation", idemdriver.OperationID(l.User, l.Key, l.CreatedAt), "op", op, "panic", v)
			out, panicked, err = nil, true, fmt.Errorf("%w: operation %q: %v", ErrHandlerPanicked, op, v)
		}
	}()
	out, err = fn(ctx, input)
	return out, false, err
}
