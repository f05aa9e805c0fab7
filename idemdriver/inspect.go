package idemdriver

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// KeyState is the state of a key as an operator sees it, decided from its
// record by the store's clock and the completers' budget of re-drives.
type KeyState string

// The states of a key. A record has exactly one of them at a given time,
// or none when it is a completed record whose expiry passed (such a record
// is gone for every purpose, as Store.Get reports it: a request with its
// key starts a new operation, and the cleaner deletes it).
const (
	// KeyInFlight: no response yet, and a lease that is still live: an
	// attempt (a client's or a completer's) holds the key.
	KeyInFlight KeyState = "in-flight"
	// KeyAbandoned: no response, the lease ran out, and fewer re-drives
	// than the completers' budget: a completer re-drives it when it is
	// due (at once, or after its backoff).
	KeyAbandoned KeyState = "abandoned"
	// KeyGivenUp: no response, the lease ran out, and the completers spent
	// their budget on it: no completer lists it again. It waits for an
	// operator (Inspector.Redrive) or for its client's retry.
	KeyGivenUp KeyState = "given-up"
	// KeyCompleted: a stored response, before its expiry.
	KeyCompleted KeyState = "completed"
)

// KeyStates lists the states in the order operators read them.
var KeyStates = []KeyState{KeyInFlight, KeyAbandoned, KeyGivenUp, KeyCompleted}

// ParseKeyState returns the state named s ("in-flight", "abandoned",
// "given-up" or "completed").
func ParseKeyState(s string) (KeyState, error) {
	for _, st := range KeyStates {
		if string(st) == s {
			return st, nil
		}
	}
	return "", fmt.Errorf("idem: unknown key state %q (want in-flight, abandoned, given-up or completed)", s)
}

// Budget returns the re-drive budget that maxRedrives stands for: itself
// when positive, else DefaultCompleterMaxAttempts, as a Completer whose
// CompleterOptions.MaxAttempts is zero spends.
func Budget(maxRedrives int) int {
	if maxRedrives <= 0 {
		return DefaultCompleterMaxAttempts
	}
	return maxRedrives
}

// StateOf returns the state of rec at now (the store's clock) for
// completers whose budget is maxRedrives (see Budget): "" for a completed
// record whose expiry passed. A lease is live while now is before
// LeaseUntil, as Claim decides; an expiry passed once now reaches
// ExpiresAt, as Get decides.
func StateOf(rec *Record, now time.Time, maxRedrives int) KeyState {
	switch {
	case rec.Response != nil && now.Before(rec.ExpiresAt):
		return KeyCompleted
	case rec.Response != nil:
		return ""
	case now.Before(rec.LeaseUntil):
		return KeyInFlight
	case rec.Redrives >= Budget(maxRedrives):
		return KeyGivenUp
	default:
		return KeyAbandoned
	}
}

// KeyInfo is a record and its state at the store's time At.
type KeyInfo struct {
	Record
	State KeyState
	// At is the store's time the state was decided at.
	At time.Time
}

// ListParams selects the keys Inspector.ListKeys returns.
type ListParams struct {
	// State is the state listed; it must be one of KeyStates.
	State KeyState
	// Limit bounds how many keys are returned; <= 0: none.
	Limit int
	// MaxRedrives is the completers' budget (CompleterOptions.MaxAttempts);
	// <= 0: DefaultCompleterMaxAttempts (see Budget).
	MaxRedrives int
}

// ErrNotGivenUp is returned by Inspector.Redrive for a key that is not in
// state KeyGivenUp: completed, in flight, or still the completers' to
// re-drive. Nothing changed. The error names the state it found.
var ErrNotGivenUp = errors.New("idem: the completers did not give this key up")

// NotGivenUpError is Inspector.Redrive's refusal; it matches ErrNotGivenUp.
type NotGivenUpError struct {
	// State is the key's state when Redrive looked.
	State KeyState
}

func (e *NotGivenUpError) Error() string {
	return fmt.Sprintf("%v: it is %s", ErrNotGivenUp, e.State)
}

// Is reports whether target is ErrNotGivenUp.
func (e *NotGivenUpError) Is(target error) bool { return target == ErrNotGivenUp }

// Inspector is implemented by stores that let an operator look at keys
// and hand a key the completers gave up on back to them. Every state is
// decided by the store's clock (the database's, where the store has one),
// the one Claim decides leases by.
type Inspector interface {
	// InspectKey returns (user, key)'s record and its state for
	// completers whose budget is maxRedrives (see Budget), or ErrNotFound
	// (also for a completed record whose expiry passed, as Get).
	InspectKey(ctx context.Context, user, key string, maxRedrives int) (*KeyInfo, error)

	// ListKeys returns up to p.Limit keys in state p.State. Keys without
	// a response (in flight, abandoned, given up) come longest waiting
	// first: the earliest lease end, then the oldest record, then user
	// and key, as Sweeper.Abandoned orders them. Completed keys come most
	// recently completed first, then user and key.
	ListKeys(ctx context.Context, p ListParams) ([]KeyInfo, error)

	// Redrive hands (user, key) back to the completers when they gave it
	// up: it sets its count of re-drives (Record.Redrives) to zero, in
	// one atomic step with the check that the key has no response, that
	// its lease ran out by the store's clock, and that it was re-driven
	// maxRedrives (see Budget) times or more. The key is then due at once
	// (Sweeper.Abandoned lists it, and its backoff starts again), and a
	// completer with that budget re-drives it as often again.
	//
	// It changes nothing else: not the owner token, the lease, the
	// fingerprint, the operation (CreatedAt), the attempts or the expiry.
	// So it never lets a key run twice: a completer still has to take it
	// over with a fenced Claim, as any retry, and an attempt whose lease
	// ran out but has not lost it keeps its lease's owner.
	//
	// It returns the count of re-drives it reset. It returns ErrNotFound
	// when there is no record (or only an expired, completed one), and a
	// *NotGivenUpError (errors.Is ErrNotGivenUp) when the key is in
	// another state; then nothing changed.
	Redrive(ctx context.Context, user, key string, maxRedrives int) (int, error)
}

// CheckRedrive returns nil when a key in state st may be re-driven, else
// Redrive's error for it. Stores call it with the state they read under
// their lock.
func CheckRedrive(st KeyState) error {
	switch st {
	case KeyGivenUp:
		return nil
	case "":
		return ErrNotFound
	default:
		return &NotGivenUpError{State: st}
	}
}
