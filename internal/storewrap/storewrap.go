// Package storewrap gives a store wrapper (idemprom's, idemotel's) the
// optional interfaces of the store it wraps, so that each wrapper writes
// only the calls it observes.
package storewrap

import (
	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

// Extend returns w, a wrapper of inner, with the optional interfaces that
// inner implements: idemdriver.Sweeper through sw (the wrapper's own Sweeper;
// nil: inner's calls pass through as they are) and idemdriver.Inspector passed
// through. The result implements an interface only if inner does, and its
// Unwrap() idem.Store returns inner.
func Extend(w, inner idem.Store, sw idemdriver.Sweeper) idem.Store {
	innerSw, isSweeper := inner.(idemdriver.Sweeper)
	in, isInspector := inner.(idemdriver.Inspector)
	if sw == nil {
		sw = innerSw
	}
	switch {
	case isSweeper && isInspector:
		return &sweepingInspecting{Store: w, Sweeper: sw, Inspector: in, inner: inner}
	case isSweeper:
		return &sweeping{Store: w, Sweeper: sw, inner: inner}
	case isInspector:
		return &inspecting{Store: w, Inspector: in, inner: inner}
	}
	return &plain{Store: w, inner: inner}
}

type plain struct {
	idem.Store
	inner idem.Store
}

func (s *plain) Unwrap() idem.Store { return s.inner }

type sweeping struct {
	idem.Store
	idemdriver.Sweeper
	inner idem.Store
}

func (s *sweeping) Unwrap() idem.Store { return s.inner }

type inspecting struct {
	idem.Store
	idemdriver.Inspector
	inner idem.Store
}

func (s *inspecting) Unwrap() idem.Store { return s.inner }

type sweepingInspecting struct {
	idem.Store
	idemdriver.Sweeper
	idemdriver.Inspector
	inner idem.Store
}

func (s *sweepingInspecting) Unwrap() idem.Store { return s.inner }
