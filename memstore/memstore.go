// Package memstore is an in-memory idem.Store for tests and single-process
// use. Its transactions buffer the handler's effects as functions that run,
// under the store's lock, only if the outcome commits.
//
// A handler reaches its transaction with [FromContext] and registers its
// effects with [Tx.OnCommit]; the middleware commits or rolls back the
// transaction, and the handler's Tx refuses to (idem.ErrTxOwned). Example shows an attempt that fails leaving
// nothing behind, its retry running again, and the next one replayed.
package memstore

import (
	"bytes"
	"context"
	"fmt"
	"hash/maphash"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

var (
	_ idem.Store         = (*Store)(nil)
	_ idemdriver.Sweeper = (*Store)(nil)
	_ idem.Tx            = (*Tx)(nil)
)

// Options configures a Store.
type Options struct {
	// Now is the clock. Default time.Now.
	Now func() time.Time
}

// Store is an in-memory idem.Store. The zero value is not usable; call New.
type Store struct {
	now func() time.Time

	mu   sync.Mutex // guards every field below and every effect run at commit
	recs map[id]*entry

	// The completed records (completed.go): encoded in arena, found by
	// the hash of their user and key in done, or in clash when another
	// record of done has the same hash.
	done  map[uint64]slot
	clash map[id]slot
	arena arena
	seed  maphash.Seed
	mask  uint64           // of the hashes: all ones; tests make records clash with less
	enc   []byte           // room for encoding a record
	locs  []*time.Location // the locations of the encoded times

	// headers are response headers by their encoded bytes, which decoded
	// responses copy instead of making strings of their own; lastHeader is
	// the last response header's bytes (shareHeader).
	headers    map[string]http.Header
	lastHeader []byte

	// The last request header kept: an in-flight record whose header
	// equals it shares it instead of holding a copy. Stored headers are
	// never changed, and never handed out: the store's answers carry
	// copies.
	lastReqHeader http.Header
}

type id struct{ user, key string }

// entry is a record in flight with room for the lease Claim hands out
// when it makes the record: one allocation.
type entry struct {
	rec   idemdriver.Record
	lease idemdriver.Lease
}

// New returns an empty Store.
func New(opts Options) *Store {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Store{
		now: opts.Now, recs: make(map[id]*entry),
		done: make(map[uint64]slot), arena: arena{cur: -1}, seed: maphash.MakeSeed(), mask: ^uint64(0),
		locs: []*time.Location{time.UTC, time.Local}, headers: make(map[string]http.Header),
	}
}

// keep returns what the store keeps of header h: last if h equals it,
// else a copy of h, which becomes *last.
func keep(h http.Header, last *http.Header) http.Header {
	if sameHeader(h, *last) {
		return *last
	}
	*last = h.Clone()
	return *last
}

// sameHeader reports whether a and b hold the same names and values, nil
// and empty apart (as Header.Clone keeps them apart).
func sameHeader(a, b http.Header) bool {
	if (a == nil) != (b == nil) || len(a) != len(b) {
		return false
	}
	for k, va := range a {
		vb, ok := b[k]
		if !ok || (va == nil) != (vb == nil) || !slices.Equal(va, vb) {
			return false
		}
	}
	return true
}

// Claim implements idem.Store.
func (s *Store) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	if err := ctx.Err(); err != nil {
		return idemdriver.Claim{}, err
	}
	p = p.Normalize()
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	k := id{p.User, p.Key}
	owner := p.Owner
	if owner == "" {
		owner = idemdriver.NewOwner()
	}
	e, ok := s.recs[k]
	if !ok {
		if sl, h, found := s.findDone(k); found {
			b := s.arena.get(sl)
			exp := s.expiresAt(b)
			switch {
			case p.Redrive != nil:
				return idemdriver.Claim{}, idem.ErrNotDue // completed
			case !now.Before(exp):
				s.deleteDone(k, h, sl) // a completed record ends at its expiry
			case !fingerprintIs(b, p.Fingerprint):
				return idemdriver.Claim{}, idem.ErrFingerprintMismatch
			default:
				return idemdriver.Claim{Response: s.response(b), ExpiresIn: exp.Sub(now)}, nil
			}
		}
	}
	var rec *idemdriver.Record
	if ok {
		rec = &e.rec
	}
	if p.Redrive != nil {
		return s.redrive(p, rec, ok, owner, now)
	}
	// A record in flight (in s.recs) never ends, since its attempt may
	// have paid.
	if ok {
		switch {
		case rec.Fingerprint != p.Fingerprint:
			return idemdriver.Claim{}, idem.ErrFingerprintMismatch
		case rec.Owner == owner:
			// This attempt's own earlier claim: its answer was lost.
			return idemdriver.Claim{Lease: leaseOf(rec), ExpiresIn: expiresIn(rec, now)}, nil
		case now.Before(rec.LeaseUntil):
			return idemdriver.Claim{}, &idem.InFlightError{LeaseUntil: rec.LeaseUntil}
		}
		rec.Owner = owner
		rec.LeaseUntil = now.Add(p.Lease)
		rec.Attempts++
		return idemdriver.Claim{Lease: leaseOf(rec), ExpiresIn: expiresIn(rec, now)}, nil
	}
	e = &entry{rec: idemdriver.Record{
		User:        p.User,
		Key:         p.Key,
		Fingerprint: p.Fingerprint,
		Method:      p.Method,
		Path:        p.Path,
		Header:      keep(p.Header, &s.lastReqHeader),
		Body:        bytes.Clone(p.Body),
		Owner:       owner,
		LeaseUntil:  now.Add(p.Lease),
		Attempts:    1,
		CreatedAt:   now,
		ExpiresAt:   now.Add(p.TTL),
	}}
	s.recs[k] = e
	e.lease = leaseValue(&e.rec) // the caller's copy: the store never reads it
	return idemdriver.Claim{Lease: &e.lease, ExpiresIn: p.TTL}, nil
}

// redrive is Claim for a completer's re-drive of the operation p.Redrive
// names: a takeover of that operation only, while it is due; never an
// insert or a replacement. Callers hold s.mu.
func (s *Store) redrive(p idemdriver.ClaimParams, rec *idemdriver.Record, ok bool, owner string, now time.Time) (idemdriver.Claim, error) {
	switch {
	case !ok || !rec.CreatedAt.Equal(p.Redrive.CreatedAt):
		return idemdriver.Claim{}, idem.ErrNotDue
	case rec.Fingerprint != p.Fingerprint:
		return idemdriver.Claim{}, idem.ErrFingerprintMismatch
	case rec.Owner == owner:
		return idemdriver.Claim{Lease: leaseOf(rec), ExpiresIn: expiresIn(rec, now)}, nil
	case now.Before(rec.LeaseUntil):
		return idemdriver.Claim{}, &idem.InFlightError{LeaseUntil: rec.LeaseUntil}
	case !p.Redrive.Due.Due(rec, now):
		return idemdriver.Claim{}, idem.ErrNotDue
	}
	rec.Owner = owner
	rec.LeaseUntil = now.Add(p.Lease)
	rec.Attempts++
	rec.Redrives++
	return idemdriver.Claim{Lease: leaseOf(rec), ExpiresIn: expiresIn(rec, now)}, nil
}

// expiresIn is how long rec has left before its expiry, never negative.
func expiresIn(rec *idemdriver.Record, now time.Time) time.Duration {
	return max(0, rec.ExpiresAt.Sub(now))
}

// owned returns the record l holds, if l still holds it. Callers hold s.mu.
func (s *Store) owned(l *idemdriver.Lease) (*entry, bool) {
	e, ok := s.recs[id{l.User, l.Key}]
	if !ok || e.rec.Owner != l.Owner {
		return nil, false
	}
	return e, true
}

// Begin implements idem.Store.
func (s *Store) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	t := &txState{s: s, lease: l}
	t.own, t.view = Tx{t: t}, Tx{t: t, handler: true}
	return &t.own, nil
}

// Release implements idem.Store.
func (s *Store) Release(ctx context.Context, l *idemdriver.Lease) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.owned(l); !ok {
		return idem.ErrFenced
	}
	delete(s.recs, id{l.User, l.Key})
	return nil
}

// Fail implements idem.Store.
func (s *Store) Fail(ctx context.Context, l *idemdriver.Lease) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.owned(l)
	if !ok {
		return idem.ErrFenced
	}
	e.rec.LeaseUntil = s.now()
	return nil
}

// Get implements idem.Store.
func (s *Store) Get(ctx context.Context, user, key string) (*idemdriver.Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := id{user, key}
	if e, ok := s.recs[k]; ok {
		return cloneRecord(&e.rec), nil
	}
	sl, _, ok := s.findDone(k)
	if !ok {
		return nil, idem.ErrNotFound
	}
	b := s.arena.get(sl)
	if !s.now().Before(s.expiresAt(b)) {
		return nil, idem.ErrNotFound
	}
	return s.record(b), nil
}

// Abandoned implements idemdriver.Sweeper.
func (s *Store) Abandoned(ctx context.Context, p idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	var out []idemdriver.Record
	for _, e := range s.recs { // a completed record is never due
		if p.Due(&e.rec, now) && p.Selects(&e.rec) {
			out = append(out, *cloneRecord(&e.rec))
		}
	}
	slices.SortFunc(out, func(a, b idemdriver.Record) int {
		if c := a.LeaseUntil.Compare(b.LeaseUntil); c != 0 {
			return c
		}
		if c := a.CreatedAt.Compare(b.CreatedAt); c != 0 {
			return c
		}
		if c := strings.Compare(a.User, b.User); c != 0 {
			return c
		}
		return strings.Compare(a.Key, b.Key)
	})
	if len(out) > max(p.Limit, 0) {
		out = out[:max(p.Limit, 0)]
	}
	return out, nil
}

// DeleteExpired implements idemdriver.Sweeper.
func (s *Store) DeleteExpired(ctx context.Context, limit int) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	n := 0
	var compact []int // chunks to compact once the ranges are over
	expired := func(sl slot) bool {
		if !now.Before(s.expiresAt(s.arena.get(sl))) {
			if s.arena.drop(sl) {
				compact = append(compact, int(sl.chunk))
			}
			n++
			return true
		}
		return false
	}
	for h, sl := range s.done {
		if n >= limit {
			break
		}
		if expired(sl) {
			delete(s.done, h)
		}
	}
	for k, sl := range s.clash {
		if n >= limit {
			break
		}
		if expired(sl) {
			delete(s.clash, k)
		}
	}
	for _, i := range compact {
		s.compact(i)
	}
	return n, nil
}

// Tx is the memstore transaction: effects registered with OnCommit run
// when the outcome commits.
//
// The store's Begin returns the middleware's Tx, whose Complete and
// Rollback end the transaction. FromContext returns the handler's: a Tx
// of the same transaction, whose Complete and Rollback refuse with an
// error matching idem.ErrTxOwned and change nothing, since the
// middleware commits the handler's effects with the stored answer, or
// drops them, once the handler returned.
type Tx struct {
	t       *txState
	handler bool // FromContext's Tx: Complete and Rollback refuse
}

// txState is one transaction, which the middleware's Tx and the
// handler's share; both are allocated with it.
type txState struct {
	s     *Store
	lease *idemdriver.Lease

	mu      sync.Mutex // guards effects and done
	effects []func()
	first   [1]func() // room for the first effect
	done    bool

	own, view Tx // Begin's Tx and FromContext's
}

// OnCommit registers fn to run, under the store's lock, when the outcome
// commits. It is how a handler "writes" in a memstore transaction.
func (tx *Tx) OnCommit(fn func()) {
	t := tx.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.effects == nil && !t.done {
		t.effects = t.first[:0]
	}
	t.effects = append(t.effects, fn)
}

// FromContext returns the memstore transaction of the claimed request that
// ctx belongs to, as the handler's Tx: its Complete and Rollback refuse
// (idem.ErrTxOwned). A wrapper's transaction (see idemdriver.UnwrapTx) is
// unwrapped. It returns idem.ErrNoTx outside a claimed request,
// idem.ErrSettled after it was answered, and idem.ErrForeignTx when the
// request's store is not a memstore.
func FromContext(ctx context.Context) (*Tx, error) {
	tx, err := idem.TxFromContext(ctx)
	if err != nil {
		return nil, err
	}
	inner := idemdriver.UnwrapTx(tx)
	mtx, ok := inner.(*Tx)
	if !ok {
		return nil, fmt.Errorf("%w: %T", idem.ErrForeignTx, inner)
	}
	return &mtx.t.view, nil
}

// errHandlerEnds is the refusal of the handler's Complete and Rollback.
func errHandlerEnds(method string) error {
	return fmt.Errorf("memstore: %s from the handler: %w", method, idem.ErrTxOwned)
}

// Complete implements idem.Tx. On the handler's Tx (FromContext) it
// refuses with an error matching idem.ErrTxOwned.
func (tx *Tx) Complete(ctx context.Context, resp *idemdriver.Response) error {
	if tx.handler {
		return errHandlerEnds("Complete")
	}
	t := tx.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return idem.ErrFenced
	}
	t.done = true
	s := t.s
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.owned(t.lease)
	if !ok {
		return idem.ErrFenced
	}
	for _, fn := range t.effects {
		fn()
	}
	k := id{e.rec.User, e.rec.Key}
	delete(s.recs, k)
	if resp == nil {
		return nil
	}
	now := s.now()
	rec := e.rec // e stays the caller's lease's
	rec.CompletedAt = now
	rec.Body = nil // only a re-drive needed it; a replay goes by the fingerprint
	if !now.Before(rec.ExpiresAt) {
		// The attempt outlived the TTL: keep the answer a TTL again, so
		// that the client's retry replays it instead of paying again.
		rec.ExpiresAt = now.Add(rec.ExpiresAt.Sub(rec.CreatedAt))
	}
	b, hdrFrom, hdrTo := s.encode(s.enc[:0], &rec, resp)
	s.enc = b
	sl := s.arena.put(b)
	s.shareHeader(b[hdrFrom:hdrTo])
	s.insertDone(k, s.hash(k), sl)
	if cap(s.enc) > maxChunk {
		s.enc = nil // not kept for the next one: one record's was large
	}
	return nil
}

// Rollback implements idem.Tx. On the handler's Tx (FromContext) it
// refuses with an error matching idem.ErrTxOwned.
func (tx *Tx) Rollback(ctx context.Context) error {
	if tx.handler {
		return errHandlerEnds("Rollback")
	}
	t := tx.t
	t.mu.Lock()
	defer t.mu.Unlock()
	t.done = true
	t.effects, t.first = nil, [1]func(){}
	return nil
}

func leaseOf(rec *idemdriver.Record) *idemdriver.Lease {
	l := leaseValue(rec)
	return &l
}

func leaseValue(rec *idemdriver.Record) idemdriver.Lease {
	return idemdriver.Lease{User: rec.User, Key: rec.Key, Owner: rec.Owner, Until: rec.LeaseUntil, Attempt: rec.Attempts, CreatedAt: rec.CreatedAt}
}

// responseCopy is a Response with room for a few header values.
type responseCopy struct {
	resp idemdriver.Response
	vals [4]string
}

// cloneHeader is h.Clone() with its values in room, when they fit.
func cloneHeader(h http.Header, room []string) http.Header {
	if h == nil {
		return nil
	}
	n := 0
	for _, v := range h {
		n += len(v)
	}
	sv := room
	if n > len(room) || room == nil { // never a nil slice for an empty one
		sv = make([]string, n)
	}
	out := make(http.Header, len(h))
	for k, v := range h {
		if v == nil {
			out[k] = nil // as Clone: nil apart from empty
			continue
		}
		n := copy(sv, v)
		out[k] = sv[:n:n]
		sv = sv[n:]
	}
	return out
}

// cloneRecord is a copy of the record in flight r (no response) that
// shares no memory with it: what the store hands out.
func cloneRecord(r *idemdriver.Record) *idemdriver.Record {
	c := *r
	c.Header = r.Header.Clone()
	c.Body = bytes.Clone(r.Body)
	return &c
}

// Len reports how many records the store holds, expired ones included.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.recs) + len(s.done) + len(s.clash)
}
