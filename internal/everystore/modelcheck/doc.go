// Package modelcheck holds the protocol's model checker (issue 10, point
// 1): a property test, built with pgregory.net/rapid's state machines, that
// drives random sequences of requests, takeovers, clock moves, completer
// runs, injected store errors and Redis faults through idem.Middleware over
// every store, and checks the protocol's guarantees after each step. The
// model, its steps and its oracle are described in modelcheck_test.go.
//
// The package has no code of its own beyond its tests.
package modelcheck
