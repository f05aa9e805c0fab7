// Package sqliteoutbox is the outbox table (package
// github.com/idem-go/idem/outbox) on SQLite, through modernc.org/sqlite:
// [New] returns a [Table] whose Add writes an event in the caller's
// transaction (a *sql.Tx, or the request's from sqlitestore.FromContext)
// and whose Take, the relay's step, holds the database's write lock
// (BEGIN IMMEDIATE) while it publishes a batch, so relays take turns. It
// is a module of its own, so that only a SQLite user compiles the driver.
package sqliteoutbox
