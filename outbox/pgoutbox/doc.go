// Package pgoutbox is the outbox table (package
// github.com/idem-go/idem/outbox) on PostgreSQL, through pgx/v5's pgxpool:
// [New] returns a [Table] whose Add writes an event in the caller's
// transaction (the request's, from pgstore.FromContext) and whose Take,
// the relay's step, lets any number of relays share the table with
// FOR UPDATE SKIP LOCKED while each ordering key's events go out in
// order. It is a module of its own, so that only a PostgreSQL user
// compiles pgx.
package pgoutbox
