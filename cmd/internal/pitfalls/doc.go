// Package pitfalls holds no code: its tests show, for each trap that an
// integration of idempotency keys falls into, that the naive approach
// really does run an operation twice (two orders, two charges) and that
// this project's approach runs it once. Each test works against the real
// order service, the real payment gateway, PostgreSQL and Redis; the README
// section "Pitfalls this design avoids" names them.
package pitfalls
