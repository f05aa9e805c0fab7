package idem_test

import (
	"errors"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

// TestStateOf: a record's state by the store's time and the budget, at
// the boundaries Claim and Get decide by.
func TestStateOf(t *testing.T) {
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	resp := &idemdriver.Response{Status: 201}
	for _, c := range []struct {
		name string
		rec  idemdriver.Record
		max  int
		want idemdriver.KeyState
	}{
		{"lease live", idemdriver.Record{LeaseUntil: now.Add(time.Nanosecond)}, 2, idemdriver.KeyInFlight},
		{"lease ends now", idemdriver.Record{LeaseUntil: now}, 2, idemdriver.KeyAbandoned},
		{"below the budget", idemdriver.Record{LeaseUntil: now, Redrives: 1}, 2, idemdriver.KeyAbandoned},
		{"at the budget", idemdriver.Record{LeaseUntil: now, Redrives: 2}, 2, idemdriver.KeyGivenUp},
		{"past the budget", idemdriver.Record{LeaseUntil: now, Redrives: 3}, 2, idemdriver.KeyGivenUp},
		{"default budget, below", idemdriver.Record{LeaseUntil: now, Redrives: idem.DefaultCompleterMaxAttempts - 1}, 0, idemdriver.KeyAbandoned},
		{"default budget, at", idemdriver.Record{LeaseUntil: now, Redrives: idem.DefaultCompleterMaxAttempts}, 0, idemdriver.KeyGivenUp},
		{"unanswered, expired", idemdriver.Record{LeaseUntil: now, ExpiresAt: now.Add(-time.Hour)}, 2, idemdriver.KeyAbandoned},
		{"completed", idemdriver.Record{Response: resp, LeaseUntil: now.Add(time.Hour), ExpiresAt: now.Add(time.Nanosecond)}, 2, idemdriver.KeyCompleted},
		{"completed, expiry now", idemdriver.Record{Response: resp, ExpiresAt: now}, 2, ""},
	} {
		if got := idemdriver.StateOf(&c.rec, now, c.max); got != c.want {
			t.Errorf("%s: StateOf = %q, want %q", c.name, got, c.want)
		}
	}
	for _, st := range idemdriver.KeyStates {
		if got, err := idemdriver.ParseKeyState(string(st)); err != nil || got != st {
			t.Errorf("ParseKeyState(%q) = %q, %v", st, got, err)
		}
	}
	if _, err := idemdriver.ParseKeyState("given up"); err == nil {
		t.Errorf("ParseKeyState(given up): no error")
	}
	if err := idemdriver.CheckRedrive(idemdriver.KeyGivenUp); err != nil {
		t.Errorf("CheckRedrive(given-up) = %v", err)
	}
	if err := idemdriver.CheckRedrive(""); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("CheckRedrive(\"\") = %v, want ErrNotFound", err)
	}
	for _, st := range []idemdriver.KeyState{idemdriver.KeyInFlight, idemdriver.KeyAbandoned, idemdriver.KeyCompleted} {
		err := idemdriver.CheckRedrive(st)
		var ng *idemdriver.NotGivenUpError
		if !errors.Is(err, idemdriver.ErrNotGivenUp) || !errors.As(err, &ng) || ng.State != st || errors.Is(err, idem.ErrNotFound) {
			t.Errorf("CheckRedrive(%s) = %v, want a NotGivenUpError naming it", st, err)
		}
	}
}
