package idem_test

import (
	"errors"
	"testing"
	"time"

	"github.com/idem-go/idem"
)

// TestOpsStateOf: a record's state by the store's time and the budget, at
// the boundaries Claim and Get decide by.
func TestOpsStateOf(t *testing.T) {
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	resp := &idem.Response{Status: 201}
	for _, c := range []struct {
		name string
		rec  idem.Record
		max  int
		want idem.KeyState
	}{
		{"lease live", idem.Record{LeaseUntil: now.Add(time.Nanosecond)}, 2, idem.KeyInFlight},
		{"lease ends now", idem.Record{LeaseUntil: now}, 2, idem.KeyAbandoned},
		{"below the budget", idem.Record{LeaseUntil: now, Redrives: 1}, 2, idem.KeyAbandoned},
		{"at the budget", idem.Record{LeaseUntil: now, Redrives: 2}, 2, idem.KeyGivenUp},
		{"past the budget", idem.Record{LeaseUntil: now, Redrives: 3}, 2, idem.KeyGivenUp},
		{"default budget, below", idem.Record{LeaseUntil: now, Redrives: idem.DefaultCompleterMaxAttempts - 1}, 0, idem.KeyAbandoned},
		{"default budget, at", idem.Record{LeaseUntil: now, Redrives: idem.DefaultCompleterMaxAttempts}, 0, idem.KeyGivenUp},
		{"unanswered, expired", idem.Record{LeaseUntil: now, ExpiresAt: now.Add(-time.Hour)}, 2, idem.KeyAbandoned},
		{"completed", idem.Record{Response: resp, LeaseUntil: now.Add(time.Hour), ExpiresAt: now.Add(time.Nanosecond)}, 2, idem.KeyCompleted},
		{"completed, expiry now", idem.Record{Response: resp, ExpiresAt: now}, 2, ""},
	} {
		if got := idem.StateOf(&c.rec, now, c.max); got != c.want {
			t.Errorf("%s: StateOf = %q, want %q", c.name, got, c.want)
		}
	}
	for _, st := range idem.KeyStates {
		if got, err := idem.ParseKeyState(string(st)); err != nil || got != st {
			t.Errorf("ParseKeyState(%q) = %q, %v", st, got, err)
		}
	}
	if _, err := idem.ParseKeyState("given up"); err == nil {
		t.Errorf("ParseKeyState(given up): no error")
	}
	if err := idem.CheckRedrive(idem.KeyGivenUp); err != nil {
		t.Errorf("CheckRedrive(given-up) = %v", err)
	}
	if err := idem.CheckRedrive(""); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("CheckRedrive(\"\") = %v, want ErrNotFound", err)
	}
	for _, st := range []idem.KeyState{idem.KeyInFlight, idem.KeyAbandoned, idem.KeyCompleted} {
		err := idem.CheckRedrive(st)
		var ng *idem.NotGivenUpError
		if !errors.Is(err, idem.ErrNotGivenUp) || !errors.As(err, &ng) || ng.State != st || errors.Is(err, idem.ErrNotFound) {
			t.Errorf("CheckRedrive(%s) = %v, want a NotGivenUpError naming it", st, err)
		}
	}
}
