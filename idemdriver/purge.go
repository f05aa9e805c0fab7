package idemdriver

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Seen names the record an operator inspected (Inspector.InspectKey):
// the attempt that held it last (Owner and Attempts) and its operation
// (CreatedAt). Purger.Purge deletes a record only while it is still this
// one, so that an attempt that took the key over after the operator looked
// (a client's retry, a completer's re-drive) is never deleted under it.
type Seen struct {
	Owner     string
	Attempts  int
	CreatedAt time.Time
}

// SeenOf returns what rec shows of the attempt and operation that hold it.
func SeenOf(rec *Record) Seen {
	return Seen{Owner: rec.Owner, Attempts: rec.Attempts, CreatedAt: rec.CreatedAt}
}

// Matches reports whether rec is still the record s was taken from: the
// same owner, count of attempts and operation.
func (s Seen) Matches(rec *Record) bool {
	return rec.Owner == s.Owner && rec.Attempts == s.Attempts && rec.CreatedAt.Equal(s.CreatedAt)
}

// ErrNotPurgeable is returned by Purger.Purge for a key it must not
// delete: one in flight, one completed, or one that changed since it was
// inspected. Nothing changed. The error (a *NotPurgeableError) says which.
var ErrNotPurgeable = errors.New("idem: the key cannot be purged")

// NotPurgeableError is Purger.Purge's refusal; it matches ErrNotPurgeable.
type NotPurgeableError struct {
	// State is the key's state when Purge looked, for completers with the
	// default budget (DefaultCompleterMaxAttempts).
	State KeyState
	// Changed reports that the record is no longer the one inspected
	// (Seen): another attempt or another operation holds the key.
	Changed bool
}

func (e *NotPurgeableError) Error() string {
	if e.Changed {
		return fmt.Sprintf("%v: it changed since it was inspected (it is %s now)", ErrNotPurgeable, e.State)
	}
	return fmt.Sprintf("%v: it is %s", ErrNotPurgeable, e.State)
}

// Is reports whether target is ErrNotPurgeable.
func (e *NotPurgeableError) Is(target error) bool { return target == ErrNotPurgeable }

// Purger is implemented by stores that let an operator delete the record
// of a key nobody is running any more, so that the next request with the
// key starts a new operation. It is apart from Inspector so that stores
// that implement only Inspector still do.
type Purger interface {
	// Purge deletes (user, key)'s record in one atomic step with the check
	// that it has no response, that its lease ran out by the store's
	// clock (the one Claim decides leases by), and that it is still the
	// record seen (see Seen). A client's retry or a completer that took
	// the key over in between makes Purge fail instead of deleting the
	// key under an attempt that may be paying; an attempt whose lease ran
	// out and that completes later finds the record gone and is fenced
	// (ErrFenced), its writes rolled back.
	//
	// A completed key is never purged: its answer protects the client's
	// retries from running the request a second time; the cleaner
	// deletes it once it expired.
	//
	// Purge does not know whether the attempts that ran made effects
	// outside the store's transaction (a payment): whoever calls it must.
	//
	// It returns the record it deleted; ErrNotFound when there is no
	// record (or only an expired, completed one, which it leaves to the
	// cleaner); a *NotPurgeableError (errors.Is ErrNotPurgeable) when the
	// key is in flight, completed, or changed since seen. Then nothing
	// changed.
	Purge(ctx context.Context, user, key string, seen Seen) (*Record, error)
}

// CheckPurge returns nil when rec may be purged at now (the store's
// clock) for an operator who saw seen, else Purge's error for it. Stores
// call it with the record they read under their lock, then delete it
// conditioned on the same.
func CheckPurge(rec *Record, now time.Time, seen Seen) error {
	st := StateOf(rec, now, 0)
	if st == "" {
		return ErrNotFound
	}
	changed := !seen.Matches(rec)
	if changed || st == KeyInFlight || st == KeyCompleted {
		return &NotPurgeableError{State: st, Changed: changed}
	}
	return nil
}
